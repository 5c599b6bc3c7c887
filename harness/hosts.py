"""Simulated hosts on one machine: each a Linux network namespace with its own address on a
bridge, so that workers bind, advertise and reach real addresses other than 127.0.0.1.

This process's own namespace is the client host: it holds the bridge's address and reaches
every host. Links are shaped with ``tc`` (``tbf``: a line rate), delayed by
``harness/link_delay.py`` (this kernel has no ``netem``) and cut with ``iptables`` (both
directions, one direction, or a random share of the packets), which leaves each host's other
links alone. Needs root, ``iproute2`` and ``iptables`` (``scripts/setup.sh`` installs them).

    with Network(["encoder", "language"]) as net:
        encoder = net["encoder"]            # .address, .netns
        net.cut(encoder, net["language"])   # a partition between the two
        net.heal(encoder, net["language"])

Everything is removed on exit (and, for a run killed before its exit, by the next run: names
carry the creating process's pid).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PREFIX = "epdh"  # every namespace, bridge and veth this module makes starts with it
LINK_DELAY = Path(__file__).resolve().parent / "link_delay.py"
RTO_MAX_SYSCTL = Path("/proc/sys/net/ipv4/tcp_rto_max_ms")


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(("-n", netns) if netns else ()), *args]
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


def _in(netns: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", netns, *command], check=check, capture_output=True, text=True,
                          timeout=30)


def missing_tools() -> list[str]:
    """What this machine lacks to simulate hosts (empty when it has everything)."""
    missing = [tool for tool in ("ip", "tc", "iptables") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


@dataclass
class Host:
    name: str
    netns: str
    address: str
    veth: str  # its end of the link, inside its namespace
    port: str  # the bridge's end, in the client's namespace

    def exec_prefix(self) -> tuple[str, ...]:
        """What runs a command on this host."""
        return ("ip", "netns", "exec", self.netns)


class Network:
    """Hosts named ``names`` on one bridge of a /24 of their own (see the module docstring)."""

    def __init__(self, names: list[str], rto_max_ms: int | None = None) -> None:
        """``rto_max_ms``: each host's ``net.ipv4.tcp_rto_max_ms`` (Linux 6.15+; None, or a kernel
        without it: the kernel's default, 120 s), the ceiling of its TCP retransmission back-off."""
        if missing := missing_tools():
            raise RuntimeError(f"simulated hosts need {', '.join(missing)}")
        reap_leftovers()
        tag = f"{PREFIX}{os.getpid()}"
        self.bridge = tag
        subnet = _free_subnet()
        self.client_address = str(subnet[1])
        self.hosts: dict[str, Host] = {}
        self._delays: list[tuple[subprocess.Popen, str | None, list[str]]] = []  # helper, namespace, its rule
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.client_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for index, name in enumerate(names):
                host = Host(name, f"{tag}-{name}", str(subnet[index + 2]), f"{tag}h{index}", f"{tag}p{index}")
                _ip("netns", "add", host.netns)
                self.hosts[name] = host
                _ip("link", "set", "lo", "up", netns=host.netns)
                _ip("link", "add", host.port, "type", "veth", "peer", "name", host.veth)
                _ip("link", "set", host.veth, "netns", host.netns)
                _ip("link", "set", host.port, "master", self.bridge, "up")
                _ip("addr", "add", f"{host.address}/24", "dev", host.veth, netns=host.netns)
                _ip("link", "set", host.veth, "up", netns=host.netns)
                if rto_max_ms is not None and RTO_MAX_SYSCTL.exists():
                    _in(host.netns, "sysctl", "-q", f"net.ipv4.tcp_rto_max_ms={rto_max_ms}")
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cut(self, a: Host, b: Host | None, one_way: bool = False) -> None:
        """Drop every packet from ``a`` to ``b`` (None: the client host) and (unless ``one_way``)
        from ``b`` to ``a``; their links to everyone else stay up."""
        address = self.client_address if b is None else b.address
        _in(a.netns, "iptables", "-I", "OUTPUT", "-d", address, "-j", "DROP")
        if not one_way:
            _in(a.netns, "iptables", "-I", "INPUT", "-s", address, "-j", "DROP")

    def delay(self, a: Host, b: Host | None, ms: float) -> None:
        """Every packet between ``a`` and ``b`` (None: the client host) ``ms`` late, each way: their
        round trip ``2 * ms`` longer. Packets are held where they arrive (``INPUT``), past the
        veth: held in the sender, they would count against its socket's TCP small-queues budget and
        throttle it far below any line rate (``netem`` frees them from it; a queue cannot)."""
        for netns, source in ((a.netns, self.client_address if b is None else b.address),
                              (None if b is None else b.netns, a.address)):
            queue = (os.getpid() * 16 + len(self._delays)) % 65536  # the client host's queues are shared by runs
            rule = ["INPUT", "-s", source, "-m", "comment", "--comment", self.bridge, "-j", "NFQUEUE", "--queue-num",
                    str(queue), "--queue-bypass"]
            helper = subprocess.Popen([*(("ip", "netns", "exec", netns) if netns else ()), sys.executable,
                                       str(LINK_DELAY), "--queue", str(queue), "--delay-ms", f"{ms:g}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._delays.append((helper, netns, rule))
            if not (helper.stdout.readline().startswith("delaying")):  # bound: packets wait for it from now on
                raise RuntimeError(f"link_delay.py did not start: {helper.stdout.read()}")
            _iptables(netns, "-I", *rule)

    def undelay(self) -> None:
        """Remove every delay."""
        for helper, netns, rule in reversed(self._delays):
            _iptables(netns, "-D", *rule, check=False)
            helper.terminate()
            helper.wait(timeout=10)
        self._delays.clear()

    def lose(self, a: Host, b: Host, share: float) -> None:
        """Drop a random ``share`` of the packets each way between ``a`` and ``b``."""
        for chain, side in (("OUTPUT", "-d"), ("INPUT", "-s")):
            _in(a.netns, "iptables", "-I", chain, side, b.address, "-m", "statistic", "--mode", "random",
                "--probability", f"{share:.4f}", "-j", "DROP")

    def heal(self, a: Host, b: Host | None = None) -> None:
        """Remove every rule :meth:`cut` and :meth:`lose` put on ``a`` (toward ``b``, or all)."""
        for chain in ("OUTPUT", "INPUT"):
            rules = _in(a.netns, "iptables", "-S", chain).stdout.splitlines()
            for rule in rules:
                if (rule.startswith(f"-A {chain} ") and rule.endswith("-j DROP")
                        and (b is None or f"{b.address}/32" in rule)):
                    _in(a.netns, "iptables", "-D", *rule.split()[1:])

    def shape(self, host: Host, rate_mbit: float) -> None:
        """Both directions of ``host``'s link at ``rate_mbit`` (a token bucket; this kernel has
        no ``netem``, so no added delay)."""
        for netns, dev in ((host.netns, host.veth), (None, host.port)):
            _ip_tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                   "burst", f"{max(32, int(rate_mbit * 1e6 / 8 / 250 / 1024))}kb", "latency", "50ms")

    def close(self) -> None:
        """Kill what runs on the hosts, then remove them and the bridge."""
        self.undelay()
        for host in self.hosts.values():
            _remove_namespace(host.netns)
        self.hosts.clear()
        _ip("link", "del", self.bridge, check=False)


def _ip_tc(netns: str | None, *args: str) -> None:
    command = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)


def _iptables(netns: str | None, *args: str, check: bool = True) -> None:
    command = ["iptables", *args] if netns is None else ["ip", "netns", "exec", netns, "iptables", *args]
    subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


def _remove_namespace(netns: str) -> None:
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", netns, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 under 10.0.0.0/8 that no interface here uses, picked from this process's pid."""
    used = _ip("-o", "-4", "addr").stdout
    for k in range(256):
        value = (os.getpid() + 7919 * k) % (200 * 256)
        subnet = ipaddress.IPv4Network(f"10.{50 + value // 256}.{value % 256}.0/24")
        if f" 10.{50 + value // 256}.{value % 256}." not in used:
            return subnet
    raise RuntimeError("no free /24 under 10.50.0.0-10.249.255.0")


def reap_leftovers() -> None:
    """Remove the namespaces and bridges of runs whose process is gone (killed before cleanup)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        if m := re.match(rf"({PREFIX}(\d+))-\S+", line):
            if not _alive(int(m.group(2))):
                _remove_namespace(line.split()[0])
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        if (m := re.search(rf" ({PREFIX}(\d+)):", line)) and not _alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)
    rules = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True, timeout=30).stdout
    for rule in rules.splitlines():  # the client host's delay rules
        if (m := re.search(rf"--comment {PREFIX}(\d+) ", rule)) and not _alive(int(m.group(1))):
            _iptables(None, "-D", *rule.split()[1:], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
