"""ZMQ control messages: fork-compatible frames, strict decoding, no pickle.

Language -> encoder (the encoder's PULL socket):

* register ``[b"None", endpoint, dst_port, session_id, packed u64 base pointers]`` plus our
  optional trailing frames ``generation``, ``num_blocks``, ``packed u64 item lengths``;
* init (7 frames) ``[room, endpoint, dst_port, session_id, "i,j,k", required_dst_info_num,
  allocated_tokens]``;
* resume (8 frames) ``[room, endpoint, dst_port, session_id, "i,j,k" (new blocks),
  required_dst_info_num, sent_tokens, allocated_tokens]``;
* abort ``[b"ABORT", room, endpoint, dst_port, generation]``;
* suspend ``[b"SUSPEND", room, endpoint, dst_port, generation]`` (ours, for sleep): write nothing
  more for the room until a resume, which may come from a new session of the same worker;
* pong ``[b"PONG", session_id, seq, generation]`` (ours): the answer to a ping, with the
  generation of the pool the answering session has registered now (a register for that session
  is taken only if the generation its endpoint answers with is the register's).

Encoder -> language (the language side's PULL socket):

* status ``[room, status]`` plus our optional ``sent_tokens`` (after the round), ``reason`` and
  ``total_tokens``; peers whose register had no extension frames (the reference fork's) get
  the two frames only, and no other message of ours. With ``total_tokens`` (status ``WaitingForInput``, sent only to peers
  whose register carried our extension frames) the encoder announces, as a first round that
  cannot hold everything starts, how many tokens there are: the language side may then send
  its resume early, and the encoder starts the next round as soon as the current one ends;
* abort ack ``[b"ABORT_ACK", room, generation]`` and suspend ack ``[b"SUSPEND_ACK", room, generation]``,
  each sent once nothing of that room is in flight;
* ping ``[b"PING", endpoint, port, seq]`` (ours, only to peers whose register carried our
  extension frames): the language side answers with a pong to ``endpoint:port``, on the same
  socket as its other messages, so the pong comes after everything it sent before.

A ``Failed`` status's reason is ``"<kind>: <message>"`` (see :mod:`connector.failures`).

Numbers are ASCII decimal. Every decoder raises :class:`ProtocolError` with a message that
names the bad frame; nothing else escapes it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from connector.failures import FailureKind
from connector.poll import KVPoll

REGISTER_TAG = b"None"
ABORT_TAG = b"ABORT"
ABORT_ACK_TAG = b"ABORT_ACK"
SUSPEND_TAG = b"SUSPEND"
SUSPEND_ACK_TAG = b"SUSPEND_ACK"
PING_TAG = b"PING"
PONG_TAG = b"PONG"

MAX_ROOM = 2**63 - 1
MAX_TOKENS = 2**31 - 1
MAX_BLOCKS_PER_MESSAGE = 1 << 20
MAX_DST_INFO_NUM = 1024
_MAX_INT_DIGITS = 20
_MAX_TEXT = 256


class ProtocolError(ValueError):
    """A message that does not follow the wire protocol (or a pool the peer's cannot feed)."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.PROTOCOL) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class RegisterMsg:
    endpoint: str
    dst_port: int
    session_id: str
    base_ptrs: tuple[int, ...]
    generation: int | None = None
    num_blocks: int | None = None
    item_lens: tuple[int, ...] | None = None

    def encode(self) -> list[bytes]:
        frames = [REGISTER_TAG, self.endpoint.encode(), str(self.dst_port).encode(),
                  self.session_id.encode(), _pack_u64(self.base_ptrs)]
        if self.generation is not None:
            frames.append(str(self.generation).encode())
            if self.num_blocks is not None and self.item_lens is not None:
                frames += [str(self.num_blocks).encode(), _pack_u64(self.item_lens)]
        return frames


@dataclass(frozen=True)
class InitMsg:
    room: int
    endpoint: str
    dst_port: int
    session_id: str
    block_ids: tuple[int, ...]
    required_dst_info_num: int
    allocated_tokens: int

    def encode(self) -> list[bytes]:
        return _request_head(self) + [str(self.allocated_tokens).encode()]


@dataclass(frozen=True)
class ResumeMsg:
    room: int
    endpoint: str
    dst_port: int
    session_id: str
    block_ids: tuple[int, ...]
    required_dst_info_num: int
    sent_tokens: int
    allocated_tokens: int

    def encode(self) -> list[bytes]:
        return _request_head(self) + [str(self.sent_tokens).encode(), str(self.allocated_tokens).encode()]


@dataclass(frozen=True)
class _RoomControl:
    """Shared frames of abort and suspend: ``[tag, room, endpoint, dst_port, generation]``."""

    room: int
    endpoint: str
    dst_port: int
    generation: int
    TAG: ClassVar[bytes] = b""

    def encode(self) -> list[bytes]:
        return [self.TAG, str(self.room).encode(), self.endpoint.encode(), str(self.dst_port).encode(),
                str(self.generation).encode()]


@dataclass(frozen=True)
class AbortMsg(_RoomControl):
    TAG: ClassVar[bytes] = ABORT_TAG


@dataclass(frozen=True)
class SuspendMsg(_RoomControl):
    TAG: ClassVar[bytes] = SUSPEND_TAG


@dataclass(frozen=True)
class StatusMsg:
    room: int
    status: KVPoll
    sent_tokens: int | None = None
    reason: str = ""
    total_tokens: int | None = None

    def encode(self, extended: bool = True) -> list[bytes]:
        """Our frames, or (``extended=False``, for a peer that registered as the reference fork
        does) exactly the fork's two: its receiving thread dies on a third."""
        frames = [str(self.room).encode(), str(int(self.status)).encode()]
        if extended and self.sent_tokens is not None:
            frames.append(str(self.sent_tokens).encode())
            if self.reason or self.total_tokens is not None:
                frames.append(self.reason.encode("utf-8", "replace")[:4096])
            if self.total_tokens is not None:
                frames.append(str(self.total_tokens).encode())
        return frames


@dataclass(frozen=True)
class _RoomAck:
    room: int
    generation: int
    TAG: ClassVar[bytes] = b""

    def encode(self) -> list[bytes]:
        return [self.TAG, str(self.room).encode(), str(self.generation).encode()]


@dataclass(frozen=True)
class AbortAckMsg(_RoomAck):
    TAG: ClassVar[bytes] = ABORT_ACK_TAG


@dataclass(frozen=True)
class SuspendAckMsg(_RoomAck):
    TAG: ClassVar[bytes] = SUSPEND_ACK_TAG


@dataclass(frozen=True)
class PingMsg:
    """Encoder -> language: is the session there? Answer to ``endpoint:port``."""

    endpoint: str
    port: int
    seq: int

    def encode(self) -> list[bytes]:
        return [PING_TAG, self.endpoint.encode(), str(self.port).encode(), str(self.seq).encode()]


@dataclass(frozen=True)
class PongMsg:
    """Language -> encoder: session ``session_id``, whose pool is of ``generation``, answers ping
    ``seq`` (``generation`` None: a peer that does not say)."""

    session_id: str
    seq: int
    generation: int | None = None

    def encode(self) -> list[bytes]:
        frames = [PONG_TAG, self.session_id.encode(), str(self.seq).encode()]
        return frames if self.generation is None else [*frames, str(self.generation).encode()]


_CONTROLS = {cls.TAG: cls for cls in (AbortMsg, SuspendMsg)}
_ACKS = {cls.TAG: cls for cls in (AbortAckMsg, SuspendAckMsg)}

EncoderBound = RegisterMsg | InitMsg | ResumeMsg | AbortMsg | SuspendMsg | PongMsg
LanguageBound = StatusMsg | AbortAckMsg | SuspendAckMsg | PingMsg


def decode_encoder_bound(frames: list[bytes]) -> EncoderBound:
    """Decode a message sent to the encoder's PULL socket."""
    if not isinstance(frames, list) or not frames or not all(isinstance(f, bytes) for f in frames):
        raise ProtocolError("message must be a non-empty list of byte frames")
    head, n = frames[0], len(frames)
    if head == REGISTER_TAG:
        if n not in (5, 6, 8):
            raise ProtocolError(f"register needs 5, 6 or 8 frames, got {n}")
        generation = _int(frames[5], "generation", 0, MAX_ROOM) if n >= 6 else None
        num_blocks = _int(frames[6], "num_blocks", 1, MAX_TOKENS) if n == 8 else None
        item_lens = _unpack_u64(frames[7], "item_lens") if n == 8 else None
        return RegisterMsg(_host(frames[1], "endpoint"), _port(frames[2]), _session(frames[3]),
                           _unpack_u64(frames[4], "base pointers"), generation, num_blocks, item_lens)
    if head == PONG_TAG:
        if n not in (3, 4):
            raise ProtocolError(f"pong needs 3 or 4 frames, got {n}")
        generation = _int(frames[3], "generation", 0, MAX_ROOM) if n == 4 else None
        return PongMsg(_session(frames[1]), _int(frames[2], "seq", 0, MAX_ROOM), generation)
    if head in _CONTROLS:
        if n != 5:
            raise ProtocolError(f"{head.decode().lower()} needs 5 frames, got {n}")
        return _CONTROLS[head](_int(frames[1], "room", 0, MAX_ROOM), _host(frames[2], "endpoint"),
                               _port(frames[3]), _int(frames[4], "generation", 0, MAX_ROOM))
    if n not in (7, 8):
        raise ProtocolError(f"expected register, abort, init (7 frames) or resume (8 frames); got {n} frames")
    room = _int(frames[0], "room", 0, MAX_ROOM)
    endpoint, dst_port, session = _host(frames[1], "endpoint"), _port(frames[2]), _session(frames[3])
    block_ids = _ids(frames[4])
    dst_info = _int(frames[5], "required_dst_info_num", 1, MAX_DST_INFO_NUM)
    allocated = _int(frames[-1], "allocated_tokens", 1, MAX_TOKENS)
    if allocated % len(block_ids):
        raise ProtocolError(f"allocated_tokens {allocated} is not a multiple of the "
                            f"{len(block_ids)} blocks sent")
    if n == 7:
        return InitMsg(room, endpoint, dst_port, session, block_ids, dst_info, allocated)
    sent = _int(frames[6], "sent_tokens", 0, MAX_TOKENS)
    return ResumeMsg(room, endpoint, dst_port, session, block_ids, dst_info, sent, allocated)


def decode_language_bound(frames: list[bytes]) -> LanguageBound:
    """Decode a message sent to the language side's PULL socket."""
    if not isinstance(frames, list) or not frames or not all(isinstance(f, bytes) for f in frames):
        raise ProtocolError("message must be a non-empty list of byte frames")
    n = len(frames)
    if frames[0] in _ACKS:
        if n != 3:
            raise ProtocolError(f"{frames[0].decode().lower()} needs 3 frames, got {n}")
        return _ACKS[frames[0]](_int(frames[1], "room", 0, MAX_ROOM), _int(frames[2], "generation", 0, MAX_ROOM))
    if frames[0] == PING_TAG:
        if n != 4:
            raise ProtocolError(f"ping needs 4 frames, got {n}")
        return PingMsg(_host(frames[1], "endpoint"), _port(frames[2]), _int(frames[3], "seq", 0, MAX_ROOM))
    if n not in (2, 3, 4, 5):
        raise ProtocolError(f"status needs 2 to 5 frames, got {n}")
    room = _int(frames[0], "room", 0, MAX_ROOM)
    status = KVPoll(_int(frames[1], "status", 0, max(KVPoll)))
    sent = _int(frames[2], "sent_tokens", 0, MAX_TOKENS) if n >= 3 else None
    reason = frames[3].decode("utf-8", "replace")[:4096] if n >= 4 else ""
    total = _int(frames[4], "total_tokens", 1, MAX_TOKENS) if n == 5 else None
    return StatusMsg(room, status, sent, reason, total)


def check_blocks(block_ids: tuple[int, ...], allocated_tokens: int, block_size: int,
                 num_blocks: int | None) -> None:
    """Check a request's destination blocks against the peer's pool geometry."""
    if allocated_tokens != len(block_ids) * block_size:
        raise ProtocolError(f"allocated_tokens {allocated_tokens} != {len(block_ids)} blocks x "
                            f"block_size {block_size} (block size mismatch between peers?)", FailureKind.MISMATCH)
    if num_blocks is not None and max(block_ids) >= num_blocks:
        raise ProtocolError(f"block id {max(block_ids)} outside the peer's pool of {num_blocks} blocks")


def _int(frame: bytes, name: str, low: int, high: int) -> int:
    if not frame or len(frame) > _MAX_INT_DIGITS or not frame.isdigit():
        raise ProtocolError(f"{name}: expected an unsigned decimal integer, got {frame[:32]!r}")
    value = int(frame)
    if not low <= value <= high:
        raise ProtocolError(f"{name}: {value} outside [{low}, {high}]")
    return value


def _port(frame: bytes) -> int:
    return _int(frame, "dst_port", 1, 65535)


def _host(frame: bytes, name: str) -> str:
    if not frame or len(frame) > _MAX_TEXT:
        raise ProtocolError(f"{name}: expected a host of 1-{_MAX_TEXT} bytes")
    try:
        text = frame.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError(f"{name}: not ASCII") from None
    if not text.isprintable() or " " in text:
        raise ProtocolError(f"{name}: contains blanks or control characters")
    return text


def _session(frame: bytes) -> str:
    text = _host(frame, "session_id")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ProtocolError(f"session_id: expected host:port, got {text!r}")
    _int(port.encode(), "session_id port", 1, 65535)
    return text


def _ids(frame: bytes) -> tuple[int, ...]:
    if not frame:
        raise ProtocolError("block ids: empty list")
    parts = frame.split(b",")
    if len(parts) > MAX_BLOCKS_PER_MESSAGE:
        raise ProtocolError(f"block ids: more than {MAX_BLOCKS_PER_MESSAGE} blocks")
    ids = tuple(_int(p, "block id", 0, MAX_TOKENS) for p in parts)
    if len(set(ids)) != len(ids):
        raise ProtocolError("block ids: duplicates")
    return ids


def _request_head(msg: InitMsg | ResumeMsg) -> list[bytes]:
    """The six frames init and resume share."""
    return [str(msg.room).encode(), msg.endpoint.encode(), str(msg.dst_port).encode(), msg.session_id.encode(),
            _join_ids(msg.block_ids), str(msg.required_dst_info_num).encode()]


def _join_ids(ids: tuple[int, ...] | list[int]) -> bytes:
    return ",".join(map(str, ids)).encode()


def _pack_u64(values: tuple[int, ...] | list[int]) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def _unpack_u64(frame: bytes, name: str) -> tuple[int, ...]:
    if not frame or len(frame) % 8 or len(frame) > 8 * 64:
        raise ProtocolError(f"{name}: expected 1-64 packed u64 values, got {len(frame)} bytes")
    return struct.unpack(f"<{len(frame) // 8}Q", frame)
