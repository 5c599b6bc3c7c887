"""Which hosts a worker may contact because of what a client sent: a bootstrap address a request
names (the two-request flow) and the encoders of ``--encoder-urls``."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from connector import FailureKind
from worker_infra.http import HTTPError

_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(value: str) -> str:
    """A host name or IP address, as it goes into a URL (IPv6 in brackets); HTTPError 400 for
    anything else (a port, a path, a query)."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        labels = value.removesuffix(".").split(".")
        if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_host must be a host name or an IP address") from None
        return value
    return f"[{address}]" if address.version == 6 else str(address)


def encoder_host(url: str) -> str:
    """The host of an ``--encoder-urls`` entry; ValueError for anything but ``http://host:port``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--encoder-urls: {url!r} is not http://host:port")
    return parts.hostname


class BootstrapAllowList:
    """The encoders a request may name by ``bootstrap_host``/``bootstrap_port`` (the two-request
    flow): the entries of ``--allowed-bootstrap-hosts`` (``host`` for any port of it, or
    ``host:port``), and nothing else: being in ``--encoder-urls`` does not open the flow, whose
    rooms a client names. Anything else is refused with 403 before this worker contacts it, so
    a client cannot make it fetch or probe a host of its choosing."""

    def __init__(self, entries: list[str]) -> None:
        self._hosts: set[str] = set()
        self._addrs: set[tuple[str, int]] = set()
        for entry in entries:
            host, port = _host_and_port(entry)
            if port is None:
                self._hosts.add(_canonical_host(host))
            else:
                self._addrs.add((_canonical_host(host), port))

    def check(self, host: str, port: int) -> None:
        """HTTPError 403 unless ``host:port`` (``host`` as :func:`check_host` returned it) is allowed."""
        name = _canonical_host(host.strip("[]"))
        if name not in self._hosts and (name, port) not in self._addrs:
            raise HTTPError(FailureKind.FORBIDDEN,
                            f"bootstrap_host {host}:{port} is not an encoder this worker may contact (the "
                            f"two-request flow needs --allowed-bootstrap-hosts {host})")


def _host_and_port(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (a bare IPv6 address has no port)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    else:
        host, port = entry, ""
    if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(f"--allowed-bootstrap-hosts: {entry!r} is not host, host:port or [IPv6]:port")
    return host, int(port) if port else None


def _canonical_host(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value.lower().removesuffix(".")
