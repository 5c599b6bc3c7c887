"""Connector settings: one table of every setting, how it is given, and its validation.

Each setting is a field of :class:`ConnectorConfig`, declared once with :func:`setting`: its
name, type and default (the field), its environment variable (the reference design's names),
its command-line flag and its help. Everything else derives from that declaration
(:data:`SETTINGS`): :meth:`ConnectorConfig.from_env`, the flags and ``--help`` of our launcher
(``sglang_ext.args``) and how the SGLang plugin reads the values SGLang parsed itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from connector.buffers import DTYPE_SIZES, BufferPool

ZERO_ALLOWED = frozenset({"unacked_block_hold"})  # settings whose 0 means "off"
MIN_SECRET_CHARS = 16
TYPES = {"int": int, "float": float, "str": str}  # field annotations are strings (postponed)


@dataclass(frozen=True)
class Setting:
    """How one :class:`ConnectorConfig` field is given (a row of :data:`SETTINGS`)."""

    name: str  # the ConnectorConfig field
    type: type  # int, float or str: the field's annotation
    default: Any  # the field's default
    env: str | None  # the environment variable from_env reads, None: none
    flag: str | None  # the command-line flag, None: the environment variable only
    help: str  # what --help says, before ", env VAR (default ...)"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # What --help shows as the default, from the configuration in effect (defaults, then the
    # environment); None: the value itself.
    shown: Callable[[ConnectorConfig], str] | None = None
    # SGLang's own parser defines this flag too: under SGLang's launchers the plugin takes SGLang's
    # parsed value, or, when SGLang leaves it unset, the environment's (then the default).
    sglang: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse gives the flag's value."""
        assert self.flag is not None, f"{self.name} has no flag"
        return self.flag.removeprefix("--").replace("-", "_")

    def parse(self, text: str) -> Any:
        """The value of the environment variable's ``text`` (ValueError naming the variable)."""
        try:
            return self.type(text)
        except ValueError:
            raise ValueError(f"{self.env}={text!r} is not a valid {self.type.__name__}") from None


def setting(default: Any, *, help: str, env: str | None = None, flag: str | None = None, metavar: str | None = None,
            choices: tuple[str, ...] | None = None, shown: Callable[[ConnectorConfig], str] | None = None,
            sglang: bool = False, repr: bool = True) -> Any:
    """A :class:`ConnectorConfig` field declared with how it is given (see :class:`Setting`)."""
    return field(default=default, repr=repr, metadata={"setting": dict(
        env=env, flag=flag, help=help, metavar=metavar, choices=choices, shown=shown, sglang=sglang)})


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")


@dataclass
class ConnectorConfig:
    """Every connector setting; a field declared with :func:`setting` is a row of :data:`SETTINGS`.
    Every number must be positive."""

    host: str = setting("127.0.0.1", flag="--host", sglang=True, help="interface every server binds")
    advertise_host: str = setting(
        "", flag="--advertise-host", env="SGLANG_EMBEDDING_ADVERTISE_HOST", metavar="ADDRESS",
        shown=lambda c: c.advertise_host or f"--host ({c.host})",
        help="the address peers on other hosts reach this worker at: put in every control message, Mooncake's "
             "session id and the bootstrap route (default: --host; needed when --host binds every interface)")
    hidden_size: int = 3584  # the embedding width: --hidden-size or the model's config (sglang_ext.args)
    dtype: str = "bfloat16"
    block_size: int = setting(
        128, flag="--multimodal-block-size", env="SGLANG_MULTIMODAL_BLOCK_SIZE", metavar="TOKENS",
        help="tokens per block")
    # 512 x 128 tokens x 3584 bf16 = 449 MiB
    num_blocks: int = setting(
        512, flag="--embedding-cache-buffer-size", env="SGLANG_EMBEDDING_CACHE_BUFFER_SIZE", metavar="BLOCKS",
        help="blocks per pool",
        shown=lambda c: f"{c.num_blocks} = {c.pool_bytes / 2**20:.0f} MiB at hidden {c.hidden_size} {c.dtype}")
    default_allocate_tokens: int = setting(
        8192, flag="--embedding-default-allocate-buffer-size", env="SGLANG_EMBEDDING_DEFAULT_ALLOCATE_BUFFER_SIZE",
        metavar="TOKENS", help="language side: tokens allocated before the size is known")
    protocol: str = setting(
        "tcp", flag="--mooncake-protocol", env="MOONCAKE_PROTOCOL", choices=("tcp", "rdma"),
        help="Mooncake transport")
    ib_device: str = setting(
        "", flag="--disaggregation-ib-device", sglang=True, shown=lambda c: c.ib_device or "none",
        help="RDMA device for Mooncake (with --mooncake-protocol rdma)")
    completion: str = "poll"  # Mooncake completion strategy, see connector.mooncake_transport
    bootstrap_timeout: float = setting(
        300.0, flag="--bootstrap-timeout", env="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", metavar="SECONDS",
        help="encode side: how long a room waits for its language peer's init")
    waiting_timeout: float = setting(
        300.0, flag="--waiting-timeout", env="SGLANG_DISAGGREGATION_WAITING_TIMEOUT", metavar="SECONDS",
        help="language side: how long a room waits without progress from its encoder (after its init or resume)")
    join_timeout: float = setting(
        15.0, flag="--join-timeout", env="SGLANG_EMBEDDING_JOIN_TIMEOUT", metavar="SECONDS",
        help="language side: how long a room waits for its encoder to say it has the room's encode request "
             "(our encoders say so at once; a fork encoder is not asked): a room a client made up ends then, "
             "its blocks back")
    resume_timeout: float = setting(
        300.0, flag="--resume-timeout", env="SGLANG_EMBEDDING_RESUME_TIMEOUT", metavar="SECONDS",
        help="encode side: how long a partly sent room waits for its resume")
    heartbeat_interval: float = setting(
        5.0, flag="--heartbeat-interval", env="SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", metavar="SECONDS",
        help="between heartbeats (language side) or pings (encode side) to a peer")
    heartbeat_max_failures: int = setting(
        2, flag="--heartbeat-max-failure", env="SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
        help="heartbeats (language side) or pings (encode side) missed in a row before a peer is dead")
    # Then the peer is declared dead for the room. Longer than an encoder's longest write into
    # its blocks (MC_TRANSFER_TIMEOUT 10 s + their size at --min-link-rate).
    abort_ack_timeout: float = setting(
        15.0, flag="--abort-ack-timeout", env="SGLANG_EMBEDDING_ABORT_ACK_TIMEOUT", metavar="SECONDS",
        help="language side: an aborted or suspended room waits this long plus its blocks' size at --min-link-rate "
             "for its encoder's acknowledgement; then that encoder counts as dead for the room (and the blocks wait "
             "up to --unacked-block-hold more)")
    # Past the ack timeout the blocks may be kept out of use longer: an encoder cut off by a
    # partition may have a write queued in Mooncake that lands when the link returns (it acks
    # only once that write settled). Off by default: a partitioned encoder's blocks then starve
    # the failover of its rooms to the other encoders (measured: a 16-client cut with a hold got
    # 503 for every client once the pool was full).
    unacked_block_hold: float = setting(
        0.0, flag="--unacked-block-hold", env="SGLANG_EMBEDDING_UNACKED_BLOCK_HOLD", metavar="SECONDS",
        help="language side: after --abort-ack-timeout keep an aborted room's blocks out of use until its encoder "
             "acknowledges (it does once no write of it can land) or is found gone, at most this much longer "
             "(0: free them then; a late write of a partitioned encoder may land in them, but the pool stays free "
             "for failover)")
    min_link_rate: float = setting(
        50e6, flag="--min-link-rate", env="SGLANG_EMBEDDING_MIN_LINK_RATE", metavar="BYTES_PER_S",
        help="the least rate one embedding write gets on the link (set it alike on both sides): the encode side "
             "reports a write failed after MC_TRANSFER_TIMEOUT plus its size at this rate, the language side holds "
             "an aborted room's blocks that much longer (a 100 Mbit/s link shared by two writes: 5e6)")
    transfer_workers: int = setting(
        2, env="SGLANG_EMBEDDING_TRANSFER_WORKERS", help="encode side: threads writing embeddings to peers")
    max_sleep: float = setting(
        3600.0, flag="--max-sleep", env="SGLANG_EMBEDDING_MAX_SLEEP", metavar="SECONDS",
        help="a sleeping peer's rooms are kept this long")
    # Flow control (docs/flow_control.md). Encode side: host memory for embeddings that no
    # language peer has asked for yet; both sides: requests waiting in a queue, and how long.
    staging_bytes: int = setting(
        4 << 30, flag="--staging-bytes", env="SGLANG_EMBEDDING_STAGING_BYTES", metavar="BYTES",
        help="encode side: host memory for embeddings no language worker has asked for yet; more wait (up to "
             "--queue-timeout) in arrival order",
        shown=lambda c: f"{c.staging_bytes} = {c.staging_bytes / 2**30:g} GiB")
    max_queued_requests: int = setting(
        256, flag="--max-queued-requests", env="SGLANG_EMBEDDING_MAX_QUEUED_REQUESTS", metavar="N", sglang=True,
        help="requests waiting for blocks (language side) or for memory and the encoder (encode side); more get "
             "503 with Retry-After at once")
    queue_timeout: float = setting(
        60.0, flag="--queue-timeout", env="SGLANG_EMBEDDING_QUEUE_TIMEOUT", metavar="SECONDS",
        help="longest wait in those queues, then 503 with Retry-After")
    # Language side: an aborted room of an encoder built from the reference fork, which cannot
    # be told to stop, keeps its blocks until that encoder's status for the round comes (after
    # it nothing more is written) or this long: the fork's own bootstrap timeout bounds how
    # long its encode request, the only thing that writes, can live.
    fork_abort_hold: float = setting(
        300.0, flag="--fork-abort-hold", env="SGLANG_EMBEDDING_FORK_ABORT_HOLD", metavar="SECONDS",
        help="language side: an aborted room of an encoder built from the reference fork (which cannot be told to "
             "stop) keeps its blocks until that encoder reports the round it owes, or this long")
    # Shared secret for control messages and bootstrap routes (connector.auth); "" = off.
    control_secret: str = setting(
        "", flag="--control-secret", env="SGLANG_EMBEDDING_CONTROL_SECRET", metavar="SECRET", repr=False,
        shown=lambda c: "set by the environment" if c.control_secret else "off",
        help=f"shared secret both workers require on control messages and bootstrap routes (at least "
             f"{MIN_SECRET_CHARS} characters; peers built from the reference fork cannot use it); prefer the "
             f"environment variable: a flag shows in the process list")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if TYPES.get(str(f.type)) is int and value <= 0:
                raise ValueError(f"{f.name} must be positive, got {value}")
            if TYPES.get(str(f.type)) is float and (value < 0 if f.name in ZERO_ALLOWED else value <= 0):
                raise ValueError(f"{f.name} must be a positive number of seconds, got {value}")
        secret = self.control_secret
        if secret and (len(secret) < MIN_SECRET_CHARS or not secret.isascii() or not secret.isprintable()
                       or " " in secret):
            raise ValueError(f"control secret must be at least {MIN_SECRET_CHARS} printable ASCII characters "
                             "without blanks")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.public_host in WILDCARD_HOSTS:
            raise ValueError(f"--host {self.host or '(empty)'} binds every interface and is no address a peer can reach "
                             "this worker at: give --advertise-host (this host's address on the network its peers use)")

    def longest_abort_hold(self, pool_bytes: int) -> float:
        """Seconds an aborted room waits for its ack, at most: the ack timeout plus the whole pool's
        bytes at ``min_link_rate`` (each room holds a part of them). Its blocks may be held
        ``unacked_block_hold`` longer (released with the pool on sleep)."""
        return self.abort_ack_timeout + pool_bytes / self.min_link_rate

    @property
    def public_host(self) -> str:
        """The address peers reach this worker at (every message that names this worker carries it)."""
        return self.advertise_host or self.host

    def blocks_for(self, num_tokens: int) -> int:
        """Whole blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def default_allocate_blocks(self) -> int:
        """The default allocation, rounded up to whole blocks."""
        return self.blocks_for(self.default_allocate_tokens)

    @property
    def secret(self) -> bytes:
        return self.control_secret.encode()

    @property
    def pool_bytes(self) -> int:
        return BufferPool.bytes_for(self.num_blocks, self.block_size, self.hidden_size, self.dtype)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> ConnectorConfig:
        """Defaults, then the environment variables of :data:`SETTINGS`, then ``overrides`` (None
        in ``overrides``: not given)."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {s.name: s.parse(env[s.env]) for s in SETTINGS if s.env and s.env in env}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


# The table: every field declared with setting(), in declaration order.
SETTINGS: tuple[Setting, ...] = tuple(
    Setting(f.name, TYPES[str(f.type)], f.default, **f.metadata["setting"])
    for f in fields(ConnectorConfig) if "setting" in f.metadata)
# field name -> environment variable read by ConnectorConfig.from_env
ENV_NAMES = {s.name: s.env for s in SETTINGS if s.env}
