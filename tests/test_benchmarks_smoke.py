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


def test_bench_load_prints_a_row_per_level_and_the_completed_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_load.py"), "--concurrency", "2,8", "--min-requests", "8",
                          "--sizes", "448x448,1024x768", "--small-pool", "16", "--json", str(tmp_path / "l.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "load_8_completed=8/8"
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert [(r["language_pool"], r["concurrency"], r["completed"]) for r in rows] == [
        ("default", 2, 8), ("default", 8, 8), ("16 blocks", 8, 8)]
    assert all(r["images_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] for r in rows)


def test_bench_generate_quick_prints_the_ttft_split_and_the_engine_ratio(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_generate.py"), "--quick", "--json",
                          str(tmp_path / "g.json"), "--plot", str(tmp_path / "g.png")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.fullmatch(r"engine_vs_bare_decode_batch4=\d+\.\d+", out.stdout.strip().splitlines()[-1])
    rows = json.loads((tmp_path / "g.json").read_text())
    [ttft] = rows["ttft"]
    assert ttft["image_tokens"] == 256 and all(ttft[k] > 0 for k in ("encode_ms", "transfer_ms", "prefill_ms"))
    assert ttft["encode_ms"] + ttft["transfer_ms"] + ttft["prefill_ms"] < ttft["ttft_ms"]
    assert [r["batch"] for r in rows["decode"]] == [1, 4] and all(r["engine_tokens_per_s"] > 0 for r in rows["decode"])
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_main_job_generates_and_matches_the_monolithic_model(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "generate_from_images.py"), "--quick", "--json",
                          str(tmp_path / "m.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "monolithic check (448x448): tokens equal (16 disaggregated, 16 monolithic)"
    assert lines[-1] == "2/2 requests generated; all checks passed"
    results = json.loads((tmp_path / "m.json").read_text())
    assert [r["image_tokens"] for r in results.values()] == [256, 782]
    assert all(len(r["output_ids"]) == 16 and r["encode_ms"] > 0 for r in results.values())


def test_bench_sleep_generations_prints_each_modes_row_and_the_ratio_with_a_7bs_kv(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_sleep.py"), "--parts", "generations", "--counts", "1",
                          "--reps", "1", "--kv-shape", "7b", "--json", str(tmp_path / "s.json")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.fullmatch(r"keep_sleep_wake_vs_memcpy_7b_1=\d+\.\d+", out.stdout.strip().splitlines()[-1])
    rows = {r["mode"]: r for r in json.loads((tmp_path / "s.generations.json").read_text())}
    assert set(rows) == {"keep", "keep+disk", "recompute+disk"}
    assert rows["keep"]["kv_bytes"] > 0 and rows["recompute+disk"]["kv_bytes"] == 0  # recompute keeps none
    assert rows["keep"]["kv_bytes"] % (28 * 2 * 4 * 128 * 2) == 0  # whole tokens of the 7B's KV: 56 KiB each
    assert rows["keep"]["checkpoint_bytes"] == 0  # no --checkpoint-dir
    assert rows["keep+disk"]["checkpoint_bytes"] > rows["recompute+disk"]["checkpoint_bytes"] > 0
    assert all(r["next_token_s"] > 0 and r["itl_s"] > 0 for r in rows.values())


def test_bench_embedding_cache_prints_the_turns_and_the_ratio(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_embedding_cache.py"), "--size", "448x448",
                          "--json", str(tmp_path / "c.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.fullmatch(r"cache_ttft_turn2_ratio=\d+\.\d+", out.stdout.strip().splitlines()[-1])
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["turn"] for r in rows["cache"]] == [1, 2, 3] == [r["turn"] for r in rows["no cache"]]
