"""Start encode/language workers as subprocesses (``python -m sglang.launch_server``), or serve
one in this process (the fast test tier)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from harness import worker_zygote

ROOT = Path(__file__).resolve().parent.parent
LIVE: set[WorkerProcess] = set()  # started and not yet seen to exit, for dump_live_workers


def embedding_width(folder: str) -> int:
    """The width of the rows an encode worker on checkpoint ``folder`` sends: a transfer-only
    receiver's ``--hidden-size`` for it."""
    import argparse

    from sglang_ext.args import embedding_width as width

    return width(argparse.Namespace(hidden_size=None, model_path=folder))


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# The ports tests give their servers: below the kernel's ephemeral range, where no outgoing
# connection takes its own port. A port in that range, freed by a killed server, can be held by
# one of the run's many connections (or by a prober's self-connect to it) when the server is
# started again on it.
PORTS = range(20000, _ephemeral_low())
_pick = random.Random()  # its own: a test that seeds the module's random (hypothesis does) picks nothing alike


def free_port() -> int:
    """A port no socket holds on 127.0.0.1 now, from :data:`PORTS`."""
    for _ in range(1000):
        port = _pick.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


SGLANG_READY = "The server is fired up and ready to roll!"  # what SGLang's server logs once it serves
SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")
FAKE_ENCODER = ROOT / "tests" / "fake_encoder.py"  # SGLang's launcher with the tests' numpy encoder
FAKE_LAUNCH = (sys.executable, str(FAKE_ENCODER))


# Where tests and scripts run their encoders: a language worker may be sent to any of them by a
# request's bootstrap_host (the two-request flow).
LOOPBACK_ENCODERS = ["--allowed-bootstrap-hosts", "127.0.0.1"]
PORT_ATTEMPTS = 3  # starts of a worker whose picked port turned out taken


class WorkerProcess:
    """One worker process; ``url`` is its HTTP address once ``READY`` was printed."""

    def __init__(self, mode: str, *extra: str, command: tuple[str, ...] = SGLANG_LAUNCH,
                 timeout: float = 120.0, env: dict[str, str] | None = None, bootstrap_port: int | None = None,
                 port: int | None = None, trusted_media: bool = True, ready: str | None = None,
                 host: str = "127.0.0.1", bind: str | None = None, netns: str | None = None,
                 fake_encoder: bool = False) -> None:
        """``command`` is what starts a worker: SGLang's launcher (``sglang serve`` works the same).
        It gets free ports (HTTP, and bootstrap for an encode worker) unless ``port`` and
        ``bootstrap_port`` name them (a restart). An encode worker reads images under the temp
        directory and from loopback URLs (where tests and scripts put them), and a language worker
        takes requests naming encoders on loopback, unless ``trusted_media`` is false. It is up
        once a log line starts with ``READY `` (our workers), or holds ``ready``: by default
        :data:`SGLANG_READY` for a language worker with ``--model-path`` (SGLang's own server).
        ``host``: the address it binds and peers reach it at; with ``bind`` (``0.0.0.0``) it binds
        that and advertises ``host`` (``--advertise-host``). ``netns``: run it in that network
        namespace (a simulated host, ``hosts.py``). ``fake_encoder``: an encode worker running the tests'
        numpy stand-in (``tests/fake_encoder.py``) instead of SGLang's encoder, without ``--model-path``."""
        if fake_encoder:
            command = FAKE_LAUNCH if command == SGLANG_LAUNCH else command
            env = {**(env or {}), worker_zygote.PRELOAD: str(FAKE_ENCODER)}
        if ready is None:
            sglang_server = mode == "language" and "--model-path" in extra and "--transfer-only" not in extra
            ready = SGLANG_READY if sglang_server else "READY "
        self.mode, self.ready_marker = mode, ready
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.port = port or free_port()
            self.bootstrap_port = (bootstrap_port or free_port()) if mode == "encode" else None
            launch = [*(("ip", "netns", "exec", netns) if netns else ()), *command]
            args = [*launch, "--disaggregation-mode", mode,
                    "--host", bind or host, *(("--advertise-host", host) if bind else ()), "--port", str(self.port),
                    *extra]
            if self.bootstrap_port:
                args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
            if mode == "encode" and trusted_media:
                args += ["--allowed-local-media-path", tempfile.gettempdir(), "--allow-private-media-urls"]
            if mode == "language" and trusted_media:
                args += LOOPBACK_ENCODERS
            # A file, not a pipe: nobody has to keep reading it for the worker to keep running.
            self.log_file = tempfile.NamedTemporaryFile("w+", prefix=f"{mode}-worker-", suffix=".log", delete=False)
            worker_env = {**os.environ, "MC_LOG_LEVEL": "ERROR", **(env or {})}
            if os.environ.get("EPD_FORK_WORKERS") == "1" and tuple(command) in (SGLANG_LAUNCH, FAKE_LAUNCH):
                self.proc = worker_zygote.spawn(args[len(launch):], worker_env, str(ROOT), self.log_file.name, netns)
            else:
                self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log_file, stderr=subprocess.STDOUT, text=True,
                                             env=worker_env)
            LIVE.add(self)
            try:
                self._wait_ready(timeout)
                break
            except RuntimeError as exc:
                # A port free_port() picked was taken before the worker bound it (another process's
                # random port: a race no pick avoids). Ports the caller named are not picked again.
                chosen = port is None and (bootstrap_port is None or mode != "encode")
                if attempt == PORT_ATTEMPTS or not chosen or "address already in use" not in str(exc).lower():
                    raise
        self.host = host
        self.url = f"http://{host}:{self.port}"

    @property
    def log(self) -> list[str]:
        return Path(self.log_file.name).read_text(errors="replace").splitlines(keepends=True)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            log = self.log
            if bind := next((line for line in log if "error while attempting to bind on address" in line), None):
                # SGLang's server logs its ready line even when uvicorn could not bind its port
                # (taken since free_port() picked it), and then shuts down
                self.stop()
                raise RuntimeError(f"{self.mode} worker could not bind its port: {bind.strip()}")
            ready = [line for line in log if (line.startswith("READY ") if self.ready_marker == "READY "
                                              else self.ready_marker in line)]
            if ready:
                self.ready_line = ready[-1]
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.mode} worker did not start:\n" + "".join(self.log[-30:]))

    def stop(self, timeout: float = 20.0) -> int:
        """SIGINT, then SIGKILL after ``timeout``; the processes it started that outlive it (SGLang's
        scheduler of a server killed while it started) are killed last, or they would spin a core."""
        descendants = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: clean shutdown
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for process in descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()
        LIVE.discard(self)
        return self.proc.returncode


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process under it (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def dump_live_workers(lines: int = 60, settle_s: float = 0.5) -> str:
    """Each live worker's thread stacks (it dumps them into its log on SIGUSR1) and its log's
    last ``lines`` lines: where a worker stands when a request to it got no answer."""
    # Only those past READY: the handler is in place then (SIGUSR1 would end one still starting).
    alive = [w for w in list(LIVE) if hasattr(w, "ready_line") and w.proc.poll() is None]
    for worker in alive:
        os.kill(worker.proc.pid, signal.SIGUSR1)
    time.sleep(settle_s if alive else 0)
    return "\n".join(f"--- {w.mode} worker pid {w.proc.pid} ({w.log_file.name}), last {lines} lines ---\n"
                     + "".join(w.log[-lines:]) for w in alive)


def start_together(*starts: Callable[[], WorkerProcess]) -> list[WorkerProcess]:
    """The workers each of ``starts`` starts, started at once (two SGLang servers start in about
    the time of one and a half on two cores); if one fails, those that started are stopped and
    its error raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        starting = [pool.submit(start) for start in starts]
    failed = [f.exception() for f in starting if f.exception() is not None]
    if failed:
        for f in starting:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in starting]


class InProcessWorker:
    """A worker built by the launcher from the same flags, its app served in this process by
    uvicorn, as ``serve`` serves it, on an event loop in a thread of its own: the fast tier's way
    to reach the real HTTP handlers. ``url`` is its address; the worker's Mooncake engine, pools
    and threads are the real ones. ``stop`` shuts it down in the order the process does."""

    def __init__(self, mode: str, *extra: str, bootstrap_port: int | None = None, encoder=None) -> None:  # noqa: ANN001
        """``encoder``: what an encode worker runs instead of SGLang's encoder for ``--model-path``
        (a test double: ``tests/fake_encoder.py``)."""
        from sglang_ext.launch_server import build, parse
        from worker_infra.http import AppServer, listening_socket

        self.mode = mode
        args = ["--disaggregation-mode", mode, "--host", "127.0.0.1", *extra]
        if mode == "encode":
            self.bootstrap_port = bootstrap_port or free_port()
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port),
                     "--allowed-local-media-path", tempfile.gettempdir(), "--allow-private-media-urls"]
        else:
            args += LOOPBACK_ENCODERS
        self.built = build(parse(args), encoder)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"in-process-{mode}-worker", daemon=True)
        self._thread.start()
        self._server = AppServer(self.built.app, listening_socket("127.0.0.1", 0))
        self._on_loop(self._server.start())
        self._running = asyncio.run_coroutine_threadsafe(self._server.run(), self._loop)
        self.url = f"http://127.0.0.1:{self._server.port}"

    def _on_loop(self, coro, timeout: float = 30.0):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        """Fail what is in flight, close the server, let the loop's pending work end, then release
        the worker (also when a step before fails)."""
        if self._loop.is_closed():
            return
        worker = self.built.worker
        try:
            worker.stop()
            self._server.should_stop()
            self._running.result(30)
            self._on_loop(self._server.close())
            self._on_loop(self._loop.shutdown_default_executor())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()
            worker.close()


@contextlib.contextmanager
def smg_gateway(worker_urls: list[str], log_path: Path, host: str = "127.0.0.1", bind: str | None = None,
                prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """smg in plain routing (round robin over ``worker_urls``), run with ``prefix`` (a simulated
    host's ``ip netns exec``), bound to ``bind`` or ``host``; its URL once it is ready."""
    with _smg(["--worker-urls", *worker_urls, "--policy", "round_robin"], log_path, host, bind, prefix) as url:
        yield url


@contextlib.contextmanager
def smg_pd_router(prefills: list[tuple[str, int]], decodes: list[str], log_path: Path,
                  host: str = "127.0.0.1", options: tuple[str, ...] = ()) -> Iterator[str]:
    """smg as SGLang's PD router (``--pd-disaggregation``, unmodified): ``prefills`` as (URL, its
    KV bootstrap port), ``decodes`` as URLs, then smg's ``options``; its URL once it is ready."""
    routes = [arg for url, port in prefills for arg in ("--prefill", url, str(port))]
    routes += [arg for url in decodes for arg in ("--decode", url)]
    with _smg(["--pd-disaggregation", *routes, *options], log_path, host) as url:
        yield url


@contextlib.contextmanager
def _smg(routing: list[str], log_path: Path, host: str, bind: str | None = None,
         prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """``smg launch`` with ``routing``, its metrics on ``host`` too (else it binds 0.0.0.0:29000,
    which a second router on the host then finds taken); its URL once ``/readiness`` says so."""
    port = free_port()
    with open(log_path, "w") as log:
        router = subprocess.Popen([*prefix, str(Path(sys.executable).parent / "smg"), "launch", *routing,
                                   "--host", bind or host, "--port", str(port), "--prometheus-host", bind or host,
                                   "--prometheus-port", str(free_port())], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert router.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if requests.get(f"{url}/readiness", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        router.terminate()
        router.wait(30)


class MooncakeMaster:
    """``mooncake_master`` (Mooncake Store's master: the cluster's embedding cache) bound to ``host``
    (its RPC and metrics servers both), run with ``prefix`` (a simulated host's ``ip netns exec``),
    its ports picked; no HTTP metadata server (the workers' store clients use P2P handshakes)."""

    def __init__(self, log_path: Path, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        import mooncake

        self.port = free_port()
        self.address = f"{host}:{self.port}"
        with open(log_path, "w") as log:
            self.process = subprocess.Popen([*prefix, str(Path(mooncake.__file__).parent / "mooncake_master"),
                                             f"--rpc_address={host}", f"--rpc_port={self.port}",
                                             f"--metrics_host={host}", f"--metrics_port={free_port()}",
                                             "--logtostderr=true", "--minloglevel=1"], stdout=log,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not _listening(host, self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start:\n{Path(log_path).read_text()[-2000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False
