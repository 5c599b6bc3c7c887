"""Connector settings: defaults, the reference design's environment names, validation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from connector.buffers import DTYPE_SIZES, BufferPool

# field name -> environment variable read by ConnectorConfig.from_env
ENV_NAMES = {
    "block_size": "SGLANG_MULTIMODAL_BLOCK_SIZE",
    "num_blocks": "SGLANG_EMBEDDING_CACHE_BUFFER_SIZE",
    "default_allocate_tokens": "SGLANG_EMBEDDING_DEFAULT_ALLOCATE_BUFFER_SIZE",
    "bootstrap_timeout": "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    "waiting_timeout": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
    "resume_timeout": "SGLANG_EMBEDDING_RESUME_TIMEOUT",
    "heartbeat_interval": "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
    "heartbeat_max_failures": "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
    "abort_ack_timeout": "SGLANG_EMBEDDING_ABORT_ACK_TIMEOUT",
    "transfer_workers": "SGLANG_EMBEDDING_TRANSFER_WORKERS",
    "max_sleep": "SGLANG_EMBEDDING_MAX_SLEEP",
    "staging_bytes": "SGLANG_EMBEDDING_STAGING_BYTES",
    "max_queued_requests": "SGLANG_EMBEDDING_MAX_QUEUED_REQUESTS",
    "queue_timeout": "SGLANG_EMBEDDING_QUEUE_TIMEOUT",
    "fork_abort_hold": "SGLANG_EMBEDDING_FORK_ABORT_HOLD",
    "control_secret": "SGLANG_EMBEDDING_CONTROL_SECRET",
}
MIN_SECRET_CHARS = 16


@dataclass
class ConnectorConfig:
    host: str = "127.0.0.1"
    hidden_size: int = 3584
    dtype: str = "bfloat16"
    block_size: int = 128  # tokens per block
    num_blocks: int = 512  # blocks per pool (512 x 128 tokens x 3584 bf16 = 449 MiB)
    default_allocate_tokens: int = 8192  # what the language side allocates before it knows the size
    protocol: str = "tcp"  # Mooncake transport: tcp or rdma
    ib_device: str = ""
    completion: str = "poll"  # Mooncake completion strategy, see connector.mooncake_transport
    bootstrap_timeout: float = 300.0  # encode side: waiting for the init of a room
    waiting_timeout: float = 300.0  # language side: no status for a room after init/resume
    resume_timeout: float = 300.0  # encode side: a partial room waiting for its resume
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    # Then the peer is declared dead for the room and its blocks freed. Longer than an encoder's
    # longest write (MC_TRANSFER_TIMEOUT 10 s + its size at 0.5 GB/s), so no late byte lands.
    abort_ack_timeout: float = 15.0
    transfer_workers: int = 2
    max_sleep: float = 3600.0  # a sleeping peer's rooms are kept this long, then fail
    # Flow control (docs/flow_control.md). Encode side: host memory for embeddings that no
    # language peer has asked for yet; both sides: requests waiting in a queue, and how long.
    staging_bytes: int = 4 << 30
    max_queued_requests: int = 256
    queue_timeout: float = 60.0
    # Language side: an aborted room of an encoder built from the reference fork, which cannot
    # be told to stop, keeps its blocks until that encoder's status for the round comes (after
    # it nothing more is written) or this long: the fork's own bootstrap timeout bounds how
    # long its encode request, the only thing that writes, can live.
    fork_abort_hold: float = 300.0
    # Shared secret for control messages and bootstrap routes (connector.auth); "" = off.
    control_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        for name in ("hidden_size", "block_size", "num_blocks", "default_allocate_tokens",
                     "heartbeat_max_failures", "transfer_workers", "staging_bytes", "max_queued_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("bootstrap_timeout", "waiting_timeout", "resume_timeout", "heartbeat_interval",
                     "abort_ack_timeout", "max_sleep", "queue_timeout", "fork_abort_hold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        secret = self.control_secret
        if secret and (len(secret) < MIN_SECRET_CHARS or not secret.isascii() or not secret.isprintable()
                       or " " in secret):
            raise ValueError(f"control secret must be at least {MIN_SECRET_CHARS} printable ASCII characters "
                             "without blanks")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")

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
        """Defaults, then the environment names in ``ENV_NAMES``, then ``overrides``."""
        env = os.environ if environ is None else environ
        types = {f.name: str(f.type) for f in fields(cls)}
        values: dict[str, object] = {}
        for name, var in ENV_NAMES.items():
            if var in env:
                cast = {"int": int, "float": float, "str": str}[types[name]]  # annotations are strings
                try:
                    values[name] = cast(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a valid {cast.__name__}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
