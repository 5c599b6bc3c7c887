"""The optional early-total extension: our peers resume while round one is written; fork peers
see exactly the fork's messages."""

from __future__ import annotations

import ctypes
import threading
import time

from connector_peer import synthetic_embedding
from test_faults import raw_language, raw_pool  # noqa: F401  (fixtures)
from test_sleep_connector import recv_any
from test_transfer import transfer

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.messages import InitMsg, RegisterMsg, ResumeMsg, StatusMsg
from connector.poll import KVPoll
from connector.sender import EmbeddingSenderManager
from connector.transport import Transport


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


class GatedTransport(Transport):
    """In-process byte mover (``memmove``) that holds its first write until released, so a round
    written beside it finishes first. The fast path for ordering; the real one is above."""

    session_id = "127.0.0.1:1"

    def __init__(self) -> None:
        self.release, self.finished = threading.Event(), []
        self._lock = threading.Lock()
        self._calls = 0

    def register(self, regions: list[tuple[int, int]]) -> None:
        pass

    def unregister(self, addresses: list[int]) -> None:
        pass

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        with self._lock:
            self._calls += 1
            call = self._calls
        if call == 1:
            assert self.release.wait(30)
        for src, dst, n in zip(src_addrs, dst_addrs, lengths, strict=True):
            ctypes.memmove(dst, src, n)
        self.finished.append(call)

    def close(self) -> None:
        pass


def test_a_round_written_beside_the_first_reports_after_it(raw_language) -> None:  # noqa: F811
    pull, push, port = raw_language
    config = ConnectorConfig(num_blocks=200, hidden_size=64, transfer_workers=2)
    src, dst = (BufferPool(200, 128, 64) for _ in range(2))
    transport, allocator = GatedTransport(), BlockAllocator(200)
    sender = EmbeddingSenderManager(config, transport, src, allocator)
    try:
        push.connect(f"tcp://127.0.0.1:{sender.rank_port}")
        push.send_multipart(RegisterMsg("127.0.0.1", port, "127.0.0.1:2", dst.base_ptrs, 1, 200, dst.item_lens).encode())
        emb = synthetic_embedding(20_000, 64, "bfloat16", seed=3)
        blocks = allocator.allocate(src.blocks_for(20_000))
        src.write(blocks, emb)
        sender.create_sender(7).send(blocks, 20_000)
        push.send_multipart(InitMsg(7, "127.0.0.1", port, "127.0.0.1:2", tuple(range(64)), 1, 8192).encode())
        assert recv_any(pull) == StatusMsg(7, KVPoll.WaitingForInput, 0, "", 20_000)
        rest = tuple(range(64, 64 + dst.blocks_for(20_000 - 8192)))
        push.send_multipart(ResumeMsg(7, "127.0.0.1", port, "127.0.0.1:2", rest, 1, 8192, len(rest) * 128).encode())
        deadline = time.monotonic() + 10
        while transport.finished != [2]:  # the second round landed while the first is held
            assert time.monotonic() < deadline, transport.finished
            time.sleep(0.01)
        assert not pull.poll(200), "a status went out before the first round landed"
        assert sender.stats["pipelined_rounds"] == 1
        transport.release.set()
        assert recv_any(pull) == StatusMsg(7, KVPoll.Transferring, 8192)
        assert recv_any(pull) == StatusMsg(7, KVPoll.Success, 20_000)
        out = Embedding.empty(20_000, 64, "bfloat16")
        dst.read_into(list(range(64)) + list(rest), out, 0, 20_000)
        out.aux[:] = dst.aux[0]  # aux travels in the first block of round one
        assert out.digests() == emb.digests()
        deadline = time.monotonic() + 5
        while not allocator.all_free():
            assert time.monotonic() < deadline, "source blocks not freed"
            time.sleep(0.01)
    finally:
        transport.release.set()
        sender.close()
