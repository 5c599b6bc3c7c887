"""The connector's timeouts at their configured values (300 s by default), crossed by moving
the managers' clock instead of sleeping: nothing fails a second before the deadline, and once
it passes the room fails on the side whose timeout it is, with the reason, every block back.
In-process over the memory transport (the same timeouts at 1 s over Mooncake, in real time,
are in test_faults)."""

from __future__ import annotations

import time

import pytest
from conftest import ManualClock
from test_faults import start_room, wait_for

from connector.failures import TransferFailure
from connector.poll import KVPoll

pytestmark = [pytest.mark.fast, pytest.mark.transports("memory")]

TICKS = 0.8  # a few of the managers' 0.25 s housekeeping ticks: long enough to act, if they would
EVENTUALLY_S = 30.0  # a poll's deadline once the clock passed a timeout: what it catches is "never"


def stays(predicate, what: str) -> None:
    time.sleep(TICKS)
    assert predicate(), what


def test_the_encoder_waits_300s_for_a_resume_and_then_fails_the_room(make_peer, make_language) -> None:
    clock = ManualClock()
    peer, lang = make_peer(clock=clock, resume_timeout=300), make_language()
    peer.call("stage", room=1, tokens=10_000, seed=1)
    receiver = start_room(lang, peer, 1, 64)
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    clock.advance(299)
    stays(lambda: peer.call("status", room=1)["status"] == "Transferring", "failed before its resume timeout")
    clock.advance(2)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, EVENTUALLY_S, "the resume timeout")
    with pytest.raises(TransferFailure, match="no resume within 300s"):
        receiver.failure_exception()
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the language pool to be free")


def test_the_encoder_waits_300s_for_data_and_for_an_init_and_then_fails_each_room(make_peer, make_language) -> None:
    clock = ManualClock()
    peer, lang = make_peer(clock=clock, bootstrap_timeout=300), make_language()
    receiver = start_room(lang, peer, 77, 4)  # initialised, but the encoder never gets the data
    # its deadline starts when the init arrives: on a loaded machine that may be after a clock move
    wait_for(lambda: peer.call("stats")["active_rooms"] == 1, EVENTUALLY_S, "the init to reach the encoder")
    peer.call("stage", room=78, tokens=300, seed=1)  # staged, but never initialised
    clock.advance(299)
    stays(lambda: receiver.poll() != KVPoll.Failed and peer.call("status", room=78)["status"] != "Failed",
          "failed before the bootstrap timeout")
    clock.advance(2)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, EVENTUALLY_S, "the bootstrap timeout")
    with pytest.raises(TransferFailure, match="timeout: .*bootstrap, no encoded data within 300s"):
        receiver.failure_exception()
    wait_for(lambda: peer.call("status", room=78)["status"] == "Failed", EVENTUALLY_S, "the staged room to time out")
    assert "bootstrap, no init within 300s" in peer.call("status", room=78)["reason"]
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the language pool to be free")


def test_a_room_no_encode_request_claims_gives_its_blocks_back_at_the_join_wait(make_peer, make_language) -> None:
    """A room a client made up (the two-request flow names it; the encoder has no encode request
    for it): the encoder never says it has it, and the language side ends it at the join wait,
    not the 300 s data wait, with its blocks back."""
    clock = ManualClock()
    peer, lang = make_peer(bootstrap_timeout=3600), make_language(clock=clock, waiting_timeout=300, join_timeout=15)
    receiver = start_room(lang, peer, 6, 8)
    assert_aborts_at(clock, receiver, 15, "timeout: encode peer .* has no encode request for room 6")
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the abort ack")


def assert_aborts_at(clock: ManualClock, receiver, seconds: float, reason: str) -> None:
    """``receiver`` still waits a second before ``seconds`` on ``clock``, and fails just after, for ``reason``."""
    clock.advance(seconds - 1)
    stays(lambda: receiver.poll() != KVPoll.Failed, f"aborted before {seconds}s")
    clock.advance(2)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, EVENTUALLY_S, f"the abort at {seconds}s")
    with pytest.raises(TransferFailure, match=reason):
        receiver.failure_exception()


def test_the_language_side_waits_300s_for_data_and_then_aborts_and_gets_its_blocks_back(make_peer,
                                                                                          make_language) -> None:
    clock = ManualClock()
    peer, lang = make_peer(bootstrap_timeout=3600), make_language(clock=clock, waiting_timeout=300)
    peer.call("claim", room=5)  # an encode request owns the room: the encoder says so at the init
    receiver = start_room(lang, peer, 5, 8)
    wait_for(lambda: receiver.machine.heard, EVENTUALLY_S, "the encoder to say it has the room")
    assert_aborts_at(clock, receiver, 300, "timeout: no data from encode peer .* within 300s")
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the abort ack")
    assert lang.manager.stats["abort_acked"] == 1  # the encoder acked: its clock never moved
    assert peer.call("stats")["counters"].get("failed:aborted") == 1  # the encoder heard the abort
