"""The benchmarks run end to end (quick modes) and print their closing ratio line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_resume_quick_writes_table_json_csv_and_plot(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_resume.py"), "--quick", "--sizes", "8193,16384,32768",
                          "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"),
                          "--plot", str(tmp_path / "r.png")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"ratio_resume_vs_single_32768=\d+\.\d+", last)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["rounds_resume"] for r in rows] == [2, 2, 2]
    assert (tmp_path / "r.csv").read_text().startswith("tokens,")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_transfer_runs_and_prints_its_ratio() -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_transfer.py"), "--sizes", "16,64", "--reps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    *_, interval, last = out.stdout.strip().splitlines()
    ratio = re.fullmatch(r"ratio_connector_vs_socket_64MiB=(\d+\.\d+)", last)
    bounds = re.fullmatch(r"ratio_64MiB_95ci=(\d+\.\d+)\.\.(\d+\.\d+)", interval)
    assert ratio and bounds, out.stdout[-2000:]
    assert float(bounds[1]) <= float(ratio[1]) <= float(bounds[2])
