"""Wire codecs: round trips, the fork's exact frames, and rejection of anything malformed."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.messages import (
    AbortAckMsg,
    AbortMsg,
    InitMsg,
    ProtocolError,
    RegisterMsg,
    ResumeMsg,
    StatusMsg,
    check_blocks,
    decode_encoder_bound,
    decode_language_bound,
)
from connector.poll import KVPoll

pytestmark = pytest.mark.fast

rooms = st.integers(0, 2**63 - 1)
ports = st.integers(1, 65535)
block_lists = st.lists(st.integers(0, 10_000), min_size=1, max_size=64, unique=True).map(tuple)


def test_init_is_the_forks_seven_frames() -> None:
    msg = InitMsg(42, "10.0.0.2", 5555, "10.0.0.2:15001", (3, 4, 9), 1, 384)
    assert msg.encode() == [b"42", b"10.0.0.2", b"5555", b"10.0.0.2:15001", b"3,4,9", b"1", b"384"]
    assert decode_encoder_bound(msg.encode()) == msg


def test_resume_is_the_forks_eight_frames() -> None:
    msg = ResumeMsg(42, "h", 5555, "h:15001", (7,), 1, 8192, 128)
    assert msg.encode() == [b"42", b"h", b"5555", b"h:15001", b"7", b"1", b"8192", b"128"]
    assert decode_encoder_bound(msg.encode()) == msg


def test_register_packs_native_u64_pointers_in_buffer_order() -> None:
    ptrs = (0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 0x7F0000004000)
    fork_frames = [b"None", b"h", b"5555", b"h:15001", b"".join(struct.pack("Q", p) for p in ptrs)]
    assert decode_encoder_bound(fork_frames) == RegisterMsg("h", 5555, "h:15001", ptrs)
    ours = RegisterMsg("h", 5555, "h:15001", ptrs, generation=7, num_blocks=64, item_lens=(1, 2, 3, 4))
    assert ours.encode()[:5] == fork_frames
    assert decode_encoder_bound(ours.encode()) == ours


def test_fork_status_without_optional_frames() -> None:
    assert decode_language_bound([b"42", b"3"]) == StatusMsg(42, KVPoll.Transferring)
    full = StatusMsg(42, KVPoll.Failed, 128, "block size mismatch")
    assert decode_language_bound(full.encode()) == full


def test_abort_and_ack_round_trip() -> None:
    abort = AbortMsg(9, "h", 5555, 123456789)
    assert abort.encode()[0] == b"ABORT"
    assert decode_encoder_bound(abort.encode()) == abort
    ack = AbortAckMsg(9, 123456789)
    assert decode_language_bound(ack.encode()) == ack


@pytest.mark.parametrize("frames, words", [
    ([b"1", b"h", b"5555", b"h:1", b"1,2", b"1"], "got 6 frames"),
    ([b"-1", b"h", b"5555", b"h:1", b"1,2", b"1", b"256"], "room"),
    ([b"1", b"h", b"70000", b"h:1", b"1,2", b"1", b"256"], "dst_port"),
    ([b"1", b"h", b"5555", b"nohostport", b"1,2", b"1", b"256"], "session_id"),
    ([b"1", b"h", b"5555", b"h:1", b"", b"1", b"256"], "empty"),
    ([b"1", b"h", b"5555", b"h:1", b"1,1", b"1", b"256"], "duplicates"),
    ([b"1", b"h", b"5555", b"h:1", b"1,x", b"1", b"256"], "block id"),
    ([b"1", b"h", b"5555", b"h:1", b"1,2", b"0", b"256"], "required_dst_info_num"),
    ([b"1", b"h", b"5555", b"h:1", b"1,2", b"1", b"255"], "not a multiple"),
    ([b"1", b"h", b"5555", b"h:1", b"1,2", b"1", b"0"], "allocated_tokens"),
    ([b"None", b"h", b"5555", b"h:1", b"abc"], "packed u64"),
    ([b"ABORT", b"1", b"h", b"5555"], "abort needs 5"),
])
def test_malformed_encoder_bound_messages_name_the_problem(frames: list[bytes], words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        decode_encoder_bound(frames)


def test_check_blocks_catches_block_size_mismatch_and_out_of_pool_ids() -> None:
    check_blocks((0, 1), 256, 128, 4)
    with pytest.raises(ProtocolError, match="block size mismatch"):
        check_blocks((0, 1), 128, 128, 4)  # peer uses 64-token blocks
    with pytest.raises(ProtocolError, match="outside the peer's pool of 4 blocks"):
        check_blocks((0, 4), 256, 128, 4)


@given(rooms, st.text("abcdefghijklmnopqrstuvwxyz0123456789.-", min_size=1, max_size=40), ports, ports,
       block_lists, st.integers(1, 8), st.integers(1, 4096), st.integers(0, 2**20))
def test_round_trip_of_random_valid_requests(room, host, port, rpc, blocks, dst_num, block_size, sent) -> None:
    session = f"{host}:{rpc}"
    init = InitMsg(room, host, port, session, blocks, dst_num, len(blocks) * block_size)
    resume = ResumeMsg(room, host, port, session, blocks, dst_num, sent, len(blocks) * block_size)
    assert decode_encoder_bound(init.encode()) == init
    assert decode_encoder_bound(resume.encode()) == resume


frames_strategy = st.lists(st.binary(max_size=48), max_size=10)


@settings(max_examples=400)
@given(frames_strategy)
def test_random_frames_only_ever_raise_protocol_error(frames: list[bytes]) -> None:
    for decode in (decode_encoder_bound, decode_language_bound):
        try:
            decode(frames)
        except ProtocolError:
            pass


@settings(max_examples=300)
@given(rooms, block_lists, st.data())
def test_truncated_or_corrupted_init_is_rejected_or_still_valid(room, blocks, data) -> None:
    frames = InitMsg(room, "127.0.0.1", 5555, "127.0.0.1:15001", blocks, 1, len(blocks) * 128).encode()
    cut = data.draw(st.integers(0, len(frames) - 1))
    with pytest.raises(ProtocolError):
        decode_encoder_bound(frames[:cut])
    i = data.draw(st.integers(0, len(frames) - 1))
    frames[i] = data.draw(st.binary(max_size=24))
    try:
        msg = decode_encoder_bound(frames)
    except ProtocolError:
        return
    assert isinstance(msg, (InitMsg, RegisterMsg, AbortMsg))  # whatever parses is fully typed
