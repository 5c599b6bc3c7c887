"""The benchmarks run end to end (quick modes) and print their closing ratio line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def small_model(seeded_checkpoint) -> list[str]:
    """``--model-path`` of a small seeded checkpoint (hidden 256, 2 layers): what a benchmark does
    is the same on it, in a fraction of the default 3584-wide checkpoint's time."""
    return ["--model-path", seeded_checkpoint(256, layers=2)]


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


def test_bench_load_prints_a_row_per_level_and_the_completed_line(tmp_path: Path, seeded_checkpoint) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_load.py"), "--model-path", seeded_checkpoint(3584),
                          "--concurrency", "2,4", "--min-requests", "4",
                          "--sizes", "448x448,1024x768", "--small-pool", "16", "--json", str(tmp_path / "l.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "load_4_completed=4/4"
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert [(r["language_pool"], r["concurrency"], r["completed"]) for r in rows] == [
        ("default", 2, 4), ("default", 4, 4), ("16 blocks", 4, 4)]
    assert all(r["images_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] for r in rows)


@pytest.mark.sglang
def test_bench_generate_quick_prints_the_ttft_split_and_the_ratio_against_sglangs_monolithic_server(
        tmp_path: Path, small_model: list[str]) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_generate.py"), *small_model, "--quick", "--json",
                          str(tmp_path / "g.json"), "--plot", str(tmp_path / "g.png")],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"epd_vs_monolithic_ttft_448x448=\d+\.\d+", lines[-1])
    assert re.match(r" +448x448 +256 +0 \|", lines[-2]), lines[-2]
    [row] = json.loads((tmp_path / "g.json").read_text())
    assert row["image_tokens"] == 256 and row["resume_rounds"] == 0 and row["reps"] == 1
    epd, mono = row["epd"], row["monolithic"]
    assert all(epd[k] > 0 for k in ("ttft_ms", "encode_ms", "prefill_ms")) and epd["transfer_ms"] >= 0
    assert epd["encode_ms"] + epd["transfer_ms"] + epd["prefill_ms"] < epd["ttft_ms"]
    assert all(mono[k] > 0 for k in ("ttft_ms", "preprocess_ms", "prefill_ms"))
    assert mono["preprocess_ms"] + mono["prefill_ms"] < mono["ttft_ms"]
    assert row["ratio"] == pytest.approx(epd["ttft_ms"] / mono["ttft_ms"], rel=0.01)
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.sglang
@pytest.mark.hosts
def test_the_main_job_generates_on_sglangs_server_across_hosts_and_matches_the_monolithic_model(
        tmp_path: Path, small_model: list[str]) -> None:
    # Across two simulated hosts (--hosts): the same job, each worker at its own address.
    # with torch.compile on, as users run it
    out = subprocess.run([sys.executable, str(SCRIPTS / "generate_from_images.py"), *small_model, "--quick", "--hosts", "--json",
                          str(tmp_path / "m.json")], capture_output=True, text=True, timeout=280,
                         env=os.environ | {"TORCH_COMPILE_DISABLE": "0"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "monolithic check (448x448): tokens equal (16 disaggregated, 16 monolithic)", lines[-2]
    assert lines[-1] == "2/2 requests generated; all checks passed"
    assert re.search(r"encoder at http://10\.[\d.]+:\d+, language server at http://10\.[\d.]+:\d+", out.stderr)
    assert [line.split()[:3] for line in lines[1:3]] == [["448x448", "256", "0"], ["2x640x480", "782", "0"]]
    results = json.loads((tmp_path / "m.json").read_text())
    assert [r["image_tokens"] for r in results.values()] == [256, 782]
    assert all(len(r["output_ids"]) == 16 and r["encode_ms"] > 0 and r["prefill_ms"] > 0 and r["transfer_ms"] >= 0
               and r["encode_ms"] + r["transfer_ms"] + r["prefill_ms"] < r["ttft_ms"] for r in results.values())


@pytest.mark.sglang
def test_bench_sleep_prints_level_1_and_level_2_mid_decode_and_the_ratio(tmp_path: Path, small_model: list[str]) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_sleep.py"), *small_model, "--counts", "1", "--reps", "1",
                          "--new-tokens", "48", "--json", str(tmp_path / "s.json")], capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"level2_vs_level1_sleep_wake_1=\d+\.\d+", lines[-1])
    assert [line.split()[:3] for line in lines[-3:-1]] == [["level", "1", "1"], ["level", "2", "1"]]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "s.json").read_text())["summary"]}
    assert set(rows) == {"level 1", "level 2"}
    level1, level2 = rows["level 1"], rows["level 2"]
    # in place: nothing recomputed, and the stream ends with the ids of its run without a sleep
    assert level1["retractions"] == 0 and level1["equal"] == level1["of"] == 1
    assert level2["retractions"] >= 1  # retracted: its KV freed, recomputed at wake-up
    assert level1["kv_bytes"] > 0 and level2["kv_bytes"] > 0  # the streams' KV when the sleep came
    assert all(r["sleep_s"] > 0 and r["wake_s"] > 0 and r["next_token_s"] > 0 and r["itl_s"] > 0
               for r in rows.values())
    assert level2["ratio"] > 0 and level1["ratio"] == 1.0


def test_bench_embedding_cache_prints_the_turns_and_the_ratio(tmp_path: Path, small_model: list[str]) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_embedding_cache.py"), *small_model, "--size", "448x448", "--turns",
                          "2", "--json", str(tmp_path / "c.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.fullmatch(r"cache_ttft_turn2_ratio=\d+\.\d+", out.stdout.strip().splitlines()[-1])
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["turn"] for r in rows["cache"]] == [1, 2] == [r["turn"] for r in rows["no cache"]]


@pytest.mark.sglang
def test_bench_stall_prints_the_gaps_in_the_receive_windows_and_in_their_controls_and_the_ratio(tmp_path: Path, small_model: list[str]) -> None:
    streams = 2
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_stall.py"), *small_model, "--streams", str(streams), "--images", "1",
                          "--quiet-s", "2", "--size", "1920x1080", "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.fullmatch(r"stall_p99_ratio=\d+\.\d+", out.stdout.strip().splitlines()[-1])
    row = json.loads((tmp_path / "s.json").read_text())
    # every stream decodes through its control window (how many tokens fall in it is the machine's speed)
    assert row["control"]["gaps"] >= streams and row["window"]["gaps"] >= 1 and len(row["windows_ms"]) == 1
    assert row["windows_ms"][0] > 0  # the receive window follows the encode, within transfer_ms


@pytest.mark.hosts
def test_bench_links_prints_each_links_share_of_its_line_rate(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_links.py"), "--links", "1000:1", "--reps", "1",
                          "--json", str(tmp_path / "l.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    share = re.fullmatch(r"link_1000mbit_connector_of_line_rate=(\d+\.\d+)", out.stdout.strip().splitlines()[-1])
    # a shaped link is not beaten: tbf's burst (0.5 MB at 1000 Mbit/s) is under 1% of the 75.6 MB sent
    assert share and 0 < float(share[1]) <= 1.05, out.stdout[-2000:]
    assert re.search(r"^link_1000mbit_resume_within_target=(True|False)$", out.stdout, re.M), out.stdout[-2000:]
    row = json.loads((tmp_path / "l.json").read_text())["1000mbit"]
    assert set(row["ms"]) == {"single", "resume", "socket", "rtt"} and row["resume_over_single"] > 0
    assert row["delay_ms"] == 1 and row["ms"]["rtt"] >= 2.0  # 1 ms each way: the round trip pays both


@pytest.mark.hosts
@pytest.mark.sglang
def test_bench_global_cache_encodes_each_image_once_across_hosts(tmp_path: Path, small_model: list[str]) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_global_cache.py"), *small_model, "--configs", "global",
                          "--chats", "4", "--images", "2", "--concurrency", "2", "--probes", "1",
                          "--json", str(tmp_path / "g.json")],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    last = re.fullmatch(r"global_cache encoder_passes=(\d+) distinct_media=(\d+) repeat_other_over_same=(\S+)",
                        out.stdout.strip().splitlines()[-1])
    assert last and last[1] == last[2], out.stdout[-2000:]  # every image encoded once in the cluster
    (row,) = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert row["config"] == "global" and row["failed"] == 0 and row["store_mb"] > 0
    assert row["first"]["n"] == int(last[2]) == 2 and row["requests"] == 6
    (probed,) = row["probes"]  # a new image, then its repeats on both servers
    assert probed["same"] > 0 and probed["other"] > 0 and float(last[3]) == pytest.approx(
        probed["other"] / probed["same"], abs=0.006)
