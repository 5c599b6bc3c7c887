"""The optional shared secret on the control plane (``--control-secret``).

With a secret, every ZMQ control message carries one more, last frame:
``b"EPD-MAC1 <unix time> <hex HMAC-SHA256>"`` over the time and every other frame; a receiver
drops a message whose MAC is missing, wrong or more than ``MAX_SKEW_S`` seconds away from its
own clock. The bootstrap server's ``/route`` wants ``Authorization: Bearer <secret>``. Without
a secret nothing is added and a trailing MAC frame from a peer that has one is ignored, so
peers built from the reference fork (which know no MAC) interoperate with it off.

The secret authenticates, it does not encrypt: frames and pool addresses still cross the network
in the clear, and a message can be replayed within ``MAX_SKEW_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

MAC_TAG = b"EPD-MAC1 "
MAX_SKEW_S = 120.0


class AuthError(ValueError):
    """A control message or HTTP request without a valid proof of the shared secret."""


def sign(frames: list[bytes], secret: bytes) -> list[bytes]:
    """``frames`` plus their MAC frame (``frames`` unchanged without a secret)."""
    if not secret:
        return frames
    stamp = str(int(time.time())).encode()
    return [*frames, MAC_TAG + stamp + b" " + _mac(secret, stamp, frames).encode()]


def verify(frames: list[bytes], secret: bytes) -> list[bytes]:
    """The message without its MAC frame; :class:`AuthError` when a secret is set and the MAC
    does not prove it."""
    signed = bool(frames) and frames[-1].startswith(MAC_TAG)
    body = frames[:-1] if signed else frames
    if not secret:
        return body
    if not signed:
        raise AuthError("no MAC frame (is --control-secret set on the peer?)")
    stamp, _, digest = frames[-1][len(MAC_TAG):].partition(b" ")
    if not stamp.isdigit() or len(stamp) > 12:
        raise AuthError("malformed MAC frame")
    when = int(stamp)
    if abs(time.time() - when) > MAX_SKEW_S:
        raise AuthError(f"MAC time {when} is more than {MAX_SKEW_S:g}s from this clock (replay, or clocks apart?)")
    if not hmac.compare_digest(digest, _mac(secret, stamp, body).encode()):
        raise AuthError("wrong MAC (a different secret?)")
    return body


def bearer(secret: bytes) -> dict[str, str]:
    """The HTTP header that proves the secret to a bootstrap server (none without a secret)."""
    return {"Authorization": "Bearer " + secret.decode()} if secret else {}


def check_bearer(header: str | None, secret: bytes) -> bool:
    """Whether an ``Authorization`` header value proves ``secret`` (always, without one)."""
    if not secret:
        return True
    return header is not None and hmac.compare_digest(header.encode(), ("Bearer " + secret.decode()).encode())


def _mac(secret: bytes, stamp: bytes, frames: list[bytes]) -> str:
    h = hmac.new(secret, stamp, hashlib.sha256)
    for frame in frames:  # length-prefixed: no two different messages hash alike
        h.update(struct.pack("<Q", len(frame)))
        h.update(frame)
    return h.hexdigest()
