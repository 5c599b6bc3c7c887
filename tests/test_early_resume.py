"""The optional early-total extension: our peers resume while round one is written; fork peers
see exactly the fork's messages."""

from __future__ import annotations

from test_faults import raw_language, raw_pool  # noqa: F401  (fixtures)
from test_sleep_connector import recv_any
from test_transfer import transfer

from connector.messages import InitMsg, RegisterMsg, StatusMsg
from connector.poll import KVPoll


def test_only_peers_with_our_register_frames_get_the_total_early(make_peer, raw_language, raw_pool) -> None:  # noqa: F811
    pull, push, port = raw_language
    transport, pool = raw_pool
    peer = make_peer(resume_timeout=1)  # the rooms left waiting for a resume end by themselves
    push.connect(f"tcp://127.0.0.1:{peer.info['rank_port']}")
    fork = RegisterMsg("127.0.0.1", port, transport.session_id, pool.base_ptrs)
    ours = RegisterMsg("127.0.0.1", port, transport.session_id, pool.base_ptrs, 1, 300, pool.item_lens)
    for room, register in ((1, fork), (2, ours)):
        peer.call("stage", room=room, tokens=20_000, seed=room)
        push.send_multipart(register.encode())
        push.send_multipart(InitMsg(room, "127.0.0.1", port, transport.session_id, tuple(range(64)), 1,
                                    8192).encode())
        first = recv_any(pull)
        if register is fork:
            assert first == StatusMsg(room, KVPoll.Transferring, 8192), first
        else:
            assert first == StatusMsg(room, KVPoll.WaitingForInput, 0, "", 20_000), first
            assert recv_any(pull) == StatusMsg(room, KVPoll.Transferring, 8192)


def test_our_language_side_resumes_while_the_first_round_is_written(make_peer, make_language) -> None:
    peer, lang = make_peer(), make_language()
    receiver = transfer(lang, peer, 5, 20_000)
    assert receiver.resume_rounds == 1
    assert lang.manager.stats["early_resumes"] == 1
