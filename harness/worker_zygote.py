"""Worker processes forked from one that imported SGLang's launcher once (the tests' way to start
many workers on a small machine).

``python -m sglang.launch_server`` spends about 10 s of CPU importing SGLang (transformers and
torch with it) before it parses a flag; a test suite that starts a few hundred workers spends most
of its time there. The zygote is a child process that imports the launcher once, then for each
worker forks and runs the launcher's ``__main__`` with the worker's arguments, environment and log
file, as ``python -m`` does (:func:`runpy.run_module`), in a network namespace when it is given one
(a simulated host: the child joins it as ``ip netns exec`` would). What the worker does from there is
the launcher's own code path, with one change: SGLang starts its scheduler and detokenizer by fork
instead of spawn (each spawned child imports SGLang again: 18 s -> 4 s a language server start
here). Nothing has run a torch kernel or started a thread in the launcher at that point.

Used by :class:`workers.WorkerProcess` when ``EPD_FORK_WORKERS=1`` (the test suite sets it) for
workers started by ``python -m sglang.launch_server``; ``sglang serve`` and ``EPD_FORK_WORKERS=0``
start fresh, SGLang's children spawned. Protocol, one JSON object per
line: the parent writes ``{"id", "argv", "env", "cwd", "log", "netns", "nice", "script"}`` (``nice``: the
CPU priority the worker starts at, as a child process inherits its parent's; ``script``: a Python
file the child runs as ``python <script> *argv`` would, instead of the launcher); the zygote answers
``{"id", "pid"}`` (or ``{"id", "error"}``) at once and ``{"id", "exit"}`` when that worker has ended
(its exit code, or minus the signal that ended it, as :class:`subprocess.Popen` reports it).

A process may share its zygote with the processes it starts (:func:`share`; the tests do, for the
scripts they run): they find a Unix socket in ``EPD_ZYGOTE_SOCKET`` and speak the same protocol
over it, so a benchmark a test runs forks its workers without importing SGLang in a zygote of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import multiprocessing
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import psutil
import setproctitle

LAUNCHER = "sglang.launch_server"
SHARED_ZYGOTE = "EPD_ZYGOTE_SOCKET"  # set by a process that shares its zygote with the ones it starts
# In a worker's environment: a Python file whose install() the forked worker calls before it runs the
# launcher (a test double putting itself in place: tests/fake_encoder.py)
PRELOAD = "EPD_WORKER_PRELOAD"


# ---- the parent's side ----------------------------------------------------------------------------

class ForkedProcess:
    """A worker the zygote forked, with what tests use of :class:`subprocess.Popen`."""

    def __init__(self, zygote: Zygote, key: int, pid: int, args: list[str]) -> None:
        self._zygote, self._key, self.pid, self.args = zygote, key, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self._key)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since poll() looked
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The parent's handle on a zygote: its own (a child process started at the first :meth:`spawn`),
    or, in a process started by one that shares its zygote (:meth:`share`), that one's, through the
    Unix socket named by ``EPD_ZYGOTE_SOCKET``. The same lines go both ways."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer: TextIO | None = None
        self._closed = threading.Event()
        self._closed.set()
        self._why_closed: Callable[[], str] = str
        self._shared_at: str | None = None  # the socket this process serves its zygote at
        self._keys = iter(range(1, 1 << 62))
        self._pids: dict[int, dict] = {}  # key -> the zygote's answer to its spawn
        self._exits: dict[int, int] = {}
        self._answered = threading.Condition(self._lock)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log: str, netns: str | None = None,
              nice: int | None = None, timeout: float = 120.0, script: str | None = None) -> ForkedProcess:
        """``nice``: the worker's CPU priority; by default the calling thread's. ``script``: run that
        Python file instead of the launcher."""
        if nice is None:
            nice = os.getpriority(os.PRIO_PROCESS, 0)
        with self._lock:
            if self._closed.is_set():
                self._open()
            key = next(self._keys)
            self._writer.write(json.dumps({"id": key, "argv": argv, "env": env, "cwd": cwd, "log": log,
                                           "netns": netns, "nice": nice, "script": script}) + "\n")
            self._writer.flush()
            if not self._answered.wait_for(lambda: key in self._pids or self._closed.is_set(), timeout):
                raise RuntimeError(f"the worker zygote did not fork within {timeout:g}s")
            answer = self._pids.pop(key, None)
            why = answer["error"] if answer and "error" in answer else None if answer else self._why_closed()
        if why is not None:
            raise RuntimeError(f"the worker zygote could not fork: {why}")
        return ForkedProcess(self, key, answer["pid"], [sys.executable, *_program(script), *argv])

    def exit_code(self, key: int) -> int | None:
        with self._lock:
            return self._exits.pop(key, None)

    def share(self, folder: str) -> None:
        """Serve this zygote to the processes this one starts from now on (the scripts a test runs): they
        fork their workers here instead of starting a zygote each (20 s of CPU on a small machine)."""
        path = os.path.join(folder, "zygote.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen()
        self._shared_at = os.environ[SHARED_ZYGOTE] = path
        threading.Thread(target=self._accept, args=(server,), name="zygote-share", daemon=True).start()

    def _open(self) -> None:
        shared = os.environ.get(SHARED_ZYGOTE)
        if shared and shared != self._shared_at:  # a parent's zygote
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(shared)
            reader, self._writer = sock.makefile("r", encoding="utf-8"), sock.makefile("w", encoding="utf-8")
            self._why_closed = lambda: f"the zygote shared at {shared} went away"
        else:
            # its own output (SGLang's import warnings, a crash) goes to a file: the workers' go to theirs
            log = tempfile.NamedTemporaryFile("w+", prefix="worker-zygote-", suffix=".log", delete=False)
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
            reader, self._writer = proc.stdout, proc.stdin
            self._why_closed = lambda: "it exited:\n" + Path(log.name).read_text()[-3000:]
        self._closed.clear()
        threading.Thread(target=self._read, args=(reader,), name="zygote-reader", daemon=True).start()

    def _read(self, reader: TextIO) -> None:
        for line in reader:
            answer = json.loads(line)
            with self._lock:
                if "exit" in answer:
                    self._exits[answer["id"]] = answer["exit"]
                else:
                    self._pids[answer["id"]] = answer
                self._answered.notify_all()
        with self._lock:
            self._closed.set()
            self._answered.notify_all()

    def _accept(self, server: socket.socket) -> None:
        while True:
            connection, _ = server.accept()
            threading.Thread(target=self._relay, args=(connection,), name="zygote-relay", daemon=True).start()

    def _relay(self, connection: socket.socket) -> None:
        """One child process's spawns, forked here, and its workers' exits, sent back; the workers it
        leaves behind when it goes (a script that crashed) are killed, as nobody can stop them now."""
        workers: dict[int, ForkedProcess] = {}  # the child's key -> its worker
        pending = b""
        connection.settimeout(0.05)
        with connection:
            try:
                while True:
                    try:
                        chunk = connection.recv(65536)
                        if not chunk:
                            break
                        pending += chunk
                    except TimeoutError:
                        pass
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        request = json.loads(line)
                        try:
                            worker = self.spawn(request["argv"], request["env"], request["cwd"], request["log"],
                                                request["netns"], request["nice"], script=request.get("script"))
                            workers[request["id"]], answer = worker, {"id": request["id"], "pid": worker.pid}
                        except RuntimeError as exc:
                            answer = {"id": request["id"], "error": str(exc)}
                        connection.sendall(json.dumps(answer).encode() + b"\n")
                    for key, worker in list(workers.items()):
                        if (code := worker.poll()) is not None:
                            del workers[key]
                            connection.sendall(json.dumps({"id": key, "exit": code}).encode() + b"\n")
            except (OSError, ValueError, KeyError):  # the child went away, or wrote what is not a request
                pass
        for worker in workers.values():
            with contextlib.suppress(psutil.Error):
                tree = psutil.Process(worker.pid)
                for process in [*tree.children(recursive=True), tree]:
                    process.kill()


_ZYGOTE = Zygote()


def spawn(argv: list[str], env: dict[str, str], cwd: str, log: str, netns: str | None = None) -> ForkedProcess:
    """Fork a worker running ``python -m sglang.launch_server *argv`` (in network namespace ``netns``)
    from this process's zygote, or from the one a parent process shares."""
    return _ZYGOTE.spawn(argv, env, cwd, log, netns)


def run_script(script: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> ForkedProcess:
    """Fork a process running ``python <script> *argv`` from the zygote: a script that needs what
    the zygote imported (SGLang) without importing it again."""
    return _ZYGOTE.spawn(argv, env, cwd, log, script=script)


def _program(script: str | None) -> list[str]:
    return [script] if script else ["-m", LAUNCHER]


def share(folder: str) -> None:
    """Let the processes this one starts from now on fork their workers from its zygote (a socket in
    ``folder``)."""
    _ZYGOTE.share(folder)


# ---- the zygote ------------------------------------------------------------------------------------

CLONE_NEWNET = 0x40000000


def _enter_network_namespace(name: str) -> None:
    """Join the namespace ``ip netns add`` made (Python 3.11 has no ``os.setns``); a fork has one thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _fork_instead_of_spawn(method: str | None, force: bool = False) -> None:
    """SGLang sets ``spawn`` before it starts its scheduler and detokenizer; in a forked worker they fork."""
    _SET_START_METHOD("fork", force=True)


_SET_START_METHOD = multiprocessing.set_start_method

def _run_worker(request: dict) -> None:
    """In the forked child: become the worker, as ``python -m sglang.launch_server`` would; never returns."""
    code, interrupted = 1, False
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        if request.get("netns"):
            _enter_network_namespace(request["netns"])
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
        multiprocessing.set_start_method = _fork_instead_of_spawn
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if dynamo := sys.modules.get("torch._dynamo.config"):  # read at its import, from the zygote's environment
            dynamo.disable = os.environ.get("TORCH_COMPILE_DISABLE") == "1"
        random.seed()  # a fresh process seeds itself from the OS; a fork would share the zygote's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        script = request.get("script")
        sys.argv = [script or sys.executable, *request["argv"]]
        # as ps shows a fresh one
        setproctitle.setproctitle(" ".join([sys.executable, *_program(script), *request["argv"]]))
        # as `python -m` has it (the working folder first), or `python <script>` (its folder)
        sys.path[:] = [str(Path(script).resolve().parent) if script else request["cwd"], *_BASE_PATH]
        try:
            if preload := request["env"].get(PRELOAD):
                runpy.run_path(preload)["install"]()
            if script:
                runpy.run_path(script, run_name="__main__")
            else:
                runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException as exc:  # noqa: BLE001 - what an interpreter does with an uncaught exception
            traceback.print_exc()
            interrupted = isinstance(exc, KeyboardInterrupt)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: by SIGINT (-2)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def serve() -> None:
    # What the workers import before they serve (the point of the zygote); none of it starts a
    # thread. Not prometheus_client: it picks how it keeps values (in memory, or in the files of
    # PROMETHEUS_MULTIPROC_DIR) once, at its import, and SGLang's server sets that folder first.
    import sglang.launch_server  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401

    import connector.mooncake_transport  # noqa: F401
    import connector.receiver  # noqa: F401
    import connector.sender  # noqa: F401
    import embedding_side.encoders  # noqa: F401
    import embedding_side.sglang_encoder  # noqa: F401
    import sglang_ext.launch_server  # noqa: F401
    import worker_infra.http  # noqa: F401

    if "prometheus_client" in sys.modules:
        raise SystemExit("worker zygote: prometheus_client was imported before a worker set its multiprocess folder")

    # setproctitle finds the memory it writes titles into on its first call: here, while the
    # environment is the one the interpreter started with (each child replaces it)
    setproctitle.setproctitle(setproctitle.getproctitle())
    parent = os.getppid()
    workers: dict[int, int] = {}  # pid -> request id
    pending = ""
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.05)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 65536).decode()
            if not chunk:
                return _stop(workers)  # the parent is gone
            pending += chunk
            while "\n" in pending:
                line, pending = pending.split("\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    print(json.dumps({"id": request["id"], "error": str(exc)}), flush=True)
                    continue
                if pid == 0:
                    _run_worker(request)
                workers[pid] = request["id"]
                print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        while workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in workers:
                print(json.dumps({"id": workers.pop(pid), "exit": os.waitstatus_to_exitcode(status)}), flush=True)
        if os.getppid() != parent:
            return _stop(workers)


def _stop(workers: dict[int, int]) -> None:
    """SIGTERM to the workers still running: a parent that stopped them all (its tests' clean-up)
    leaves none; one killed before it could would leave them serving with nobody to stop them."""
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


_BASE_PATH = sys.path[1:]  # without this script's folder

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    serve()
