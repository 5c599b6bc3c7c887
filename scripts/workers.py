"""Start encode/language workers as subprocesses (``python -m sglang_ext.launch_server``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """One worker process; ``url`` is its HTTP address once ``READY`` was printed."""

    def __init__(self, mode: str, *extra: str, command: tuple[str, ...] = (sys.executable, "-m", "sglang_ext.launch_server"),
                 timeout: float = 120.0, env: dict[str, str] | None = None, bootstrap_port: int | None = None,
                 port: int | None = None, trusted_media: bool = True) -> None:
        """``command`` is what starts a worker: ours by default, or SGLang's launchers. It gets free
        ports (HTTP, and bootstrap for an encode worker) unless ``port`` and ``bootstrap_port``
        name them (a restart). An encode worker reads images under the temp directory and from
        loopback URLs (where tests and scripts put them) unless ``trusted_media`` is false."""
        self.mode, self.port = mode, port or free_port()
        self.bootstrap_port = (bootstrap_port or free_port()) if mode == "encode" else None
        args = [*command, "--disaggregation-mode", mode, "--host", "127.0.0.1",
                "--port", str(self.port), *extra]
        if self.bootstrap_port:
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if mode == "encode" and trusted_media:
            args += ["--allowed-local-media-path", tempfile.gettempdir(), "--allow-private-media-urls"]
        # A file, not a pipe: nobody has to keep reading it for the worker to keep running.
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix=f"{mode}-worker-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log_file, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "MC_LOG_LEVEL": "ERROR", **(env or {})})
        self._wait_ready(timeout)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> list[str]:
        return Path(self.log_file.name).read_text(errors="replace").splitlines(keepends=True)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = [line for line in self.log if line.startswith("READY ")]
            if ready:
                self.ready_line = ready[-1]
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.mode} worker did not start:\n" + "".join(self.log[-30:]))

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: clean shutdown
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def model_workers(folder: str, *language_args: str, both: tuple[str, ...] = (), timeout: float = 120.0,
                  one_request: bool = False) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """An encode and a language worker on one checkpoint folder (``both``: flags for each;
    ``one_request``: the language worker sends images to the encoder itself, ``--encoder-urls``);
    stopped on leaving, and a worker that does not exit cleanly is an error."""
    encode = WorkerProcess("encode", "--model-path", folder, *both, timeout=timeout)
    try:
        dispatch = ("--encoder-urls", encode.url) if one_request else ()
        lang = WorkerProcess("language", "--model-path", folder, *both, *dispatch, *language_args, timeout=timeout)
    except BaseException:
        encode.stop()
        raise
    try:
        yield encode, lang
    finally:
        codes = lang.stop(), encode.stop()
    if codes != (0, 0):
        raise RuntimeError(f"workers exited with {codes}:\n" + "".join(lang.log[-20:] + encode.log[-20:]))
