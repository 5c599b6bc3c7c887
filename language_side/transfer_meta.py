"""How a request's media came to the language side: one part's transfer, as the language worker
received it, and a request's, joined from its parts and its media; what a response's
``meta_info`` carries of it."""

from __future__ import annotations

from dataclasses import dataclass, field

COUNTS = ("num_tokens", "resume_rounds", "encoder_retries", "cached_images", "stored_images")  # joined: added
TIMES = ("transfer_ms", "copy_ms", "encode_ms", "encoder_wait_ms", "queue_ms")  # joined: the longest
# in a response's meta_info (those given: a two-request room's has no encode_ms of ours and no cache)
RESPONSE_FIELDS = ("resume_rounds", "transfer_ms", "copy_ms", "encode_ms", "encoder_wait_ms", "queue_ms",
                   "encoder_retries", "cached_images", "stored_images", "sha256")


@dataclass
class TransferMeta:
    num_tokens: int = 0
    resume_rounds: int = 0
    encoder_retries: int = 0
    cached_images: int | None = None  # images: how many came from this worker's embedding cache
    stored_images: int | None = None  # images: how many came from the cluster's (Mooncake Store)
    transfer_ms: float = 0.0  # from the init to the assembled embedding (the encoder's wait included)
    copy_ms: float = 0.0  # from the landing to the rows out of the pool
    encode_ms: float | None = None  # the encoder's decode, preprocessing and forward pass
    encoder_wait_ms: float = 0.0  # from the init to the encoder's first write
    queue_ms: float = 0.0  # from the request's arrival to its init (waiting for blocks)
    encoders: list[str] = field(default_factory=list)  # the URL (or bootstrap address) of each part's encoder
    sha256: str | None = None  # a two-request room's rows, as the encoder's answer has them
    preprocessing: str | None = None  # one part's: the fingerprint of the encoder that made it
    attempts: int = 1  # one part's: the encoders it was sent to

    @classmethod
    def received(cls, transfer: dict, **more: object) -> TransferMeta:
        """One part's, from the language worker's answer (the names the transfer-only API gives)."""
        return cls(num_tokens=int(transfer["num_tokens"]), resume_rounds=int(transfer["resume_rounds"]),
                   transfer_ms=transfer["transfer_ms"], copy_ms=transfer["copy_ms"],
                   encoder_wait_ms=transfer["encoder_wait_ms"], queue_ms=transfer["queue_ms"], **more)

    @classmethod
    def joined(cls, metas: list[TransferMeta]) -> TransferMeta:
        """Parts (or media) received side by side: counts added, times the longest, the encoders
        in order, a failed first attempt of a part counted as a retry."""
        if len(metas) == 1 and metas[0].attempts == 1:
            return metas[0]
        joined = cls(encoders=[url for meta in metas for url in meta.encoders])
        for name in COUNTS + TIMES:
            given = [value for meta in metas if (value := getattr(meta, name)) is not None]
            if given:
                setattr(joined, name, max(given) if name in TIMES else sum(given))
        joined.encoder_retries += sum(meta.attempts - 1 for meta in metas)
        return joined

    def response_fields(self) -> dict:
        """What a response's ``meta_info`` gets."""
        return {name: value for name in RESPONSE_FIELDS if (value := getattr(self, name)) is not None}

