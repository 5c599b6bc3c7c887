"""The tests' worker zygote (harness/worker_zygote.py), shared with the scripts they run: a script
forks its workers from it instead of importing SGLang in a zygote of its own, gets their exit codes
through the socket, and what it leaves running when it ends is killed. A worker starts at its
starter's CPU priority (the serial tests raise theirs: tests/conftest.py), as a child process would.
A Python file runs forked from it as ``python <file> *argv`` would, with what the zygote imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from harness import worker_zygote
from harness.workers import ROOT

# A script that lowers its CPU priority, starts two transfer-only receivers (no model) by SGLang's
# launcher, stops one, and ends without stopping the other.
SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT / "scripts")!r})
import psutil
from harness.workers import WorkerProcess
wanted = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
os.setpriority(os.PRIO_PROCESS, 0, wanted)
kept = WorkerProcess("language", "--transfer-only", "--device", "cpu")
stopped = WorkerProcess("language", "--transfer-only", "--device", "cpu")
code = stopped.stop()
print(json.dumps({{"kept": kept.proc.pid, "zygote": psutil.Process(kept.proc.pid).ppid(),
                  "nice": psutil.Process(kept.proc.pid).nice(), "wanted": wanted,
                  "descendants": [p.pid for p in psutil.Process().children(recursive=True)],
                  "stop_code": code}}), flush=True)
os._exit(0)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_script_forks_from_the_shared_zygote_and_what_it_leaves_running_is_killed() -> None:
    assert os.environ.get(worker_zygote.SHARED_ZYGOTE), "conftest shares the run's zygote"
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    zygote = psutil.Process(report["zygote"])
    assert "worker_zygote.py" in " ".join(zygote.cmdline())
    assert report["zygote"] not in report["descendants"]  # not a zygote of the script's own
    assert report["nice"] == report["wanted"] != zygote.nice()  # the script's priority, not the zygote's
    # its exit came back through the socket (never relayed, stop() would kill it past 20 s and wait forever)
    assert report["stop_code"] == 0, report
    deadline = time.monotonic() + 30
    while alive(report["kept"]):
        assert time.monotonic() < deadline, "the worker the script left running is still alive"
        time.sleep(0.1)
    assert zygote.is_running()  # the run's zygote serves on


def test_a_script_runs_forked_from_the_zygote_with_its_arguments_and_exit_code(tmp_path) -> None:
    script = tmp_path / "probe.py"
    script.write_text("import json, sys\n"
                      "print(json.dumps({'argv': sys.argv[1:], 'sglang': 'sglang.launch_server' in sys.modules,\n"
                      "                  'folder': sys.path[0]}))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    log = tmp_path / "probe.log"
    proc = worker_zygote.run_script(str(script), ["3", "two words"], dict(os.environ), str(tmp_path), str(log))
    assert proc.wait(timeout=60) == 3, log.read_text()
    assert json.loads(log.read_text().strip().splitlines()[-1]) == {
        "argv": ["3", "two words"], "sglang": True, "folder": str(tmp_path)}  # imported once, by the zygote
