"""The SGLang plugin, against the real SGLang installed in this environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from sglang_ext.cpu.gemm import slow_bf16
from sglang_ext.language_flags import cpu_kv_tokens
from sglang_ext.pd import PD_ROLES

pytestmark = pytest.mark.sglang

# Loads the plugins as SGLang's launcher does, then parses each case's argv with SGLang's own
# prepare_server_args; our worker is replaced by a print of the configuration it would get. One
# process parses every case (an import of SGLang costs seconds): a JSON line per case with its
# exit code and what it printed.
PARSE = """
import contextlib, io, json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang_ext.launch_server as launcher
launcher.run = lambda args: print("WORKER " + json.dumps(vars(args), sort_keys=True, default=repr))
from sglang.srt.server_args import prepare_server_args
for case, argv in json.loads(sys.argv[1]).items():
    out, err, code = io.StringIO(), io.StringIO(), 0
    os.environ.pop("SGLANG_MM_PRECOMPUTE_HASH", None)  # each case sees what it sets itself
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            server_args = prepare_server_args(argv)
            print("SGLANG " + json.dumps({k: repr(getattr(server_args, k)) for k in
                                          sorted(type(server_args).__struct_fields__) if not k.startswith("_")}))
            print("ENV " + json.dumps({"SGLANG_MM_PRECOMPUTE_HASH": os.environ.get("SGLANG_MM_PRECOMPUTE_HASH")}))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            print(exc.code if not isinstance(exc.code, int) else "", file=err)
    print("CASE " + json.dumps({"case": case, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}))
"""


@dataclass
class Parsed:
    returncode: int
    stdout: str
    stderr: str


def parse_all(cases: dict[str, tuple[str, ...]], plugins: str | None = None) -> dict[str, Parsed]:
    env = None if plugins is None else {**os.environ, "SGLANG_PLUGINS": plugins}
    res = subprocess.run([sys.executable, "-c", PARSE, json.dumps(cases)], capture_output=True, text=True, env=env,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    found = [json.loads(x[5:]) for x in res.stdout.splitlines() if x.startswith("CASE ")]
    return {c["case"]: Parsed(c["code"], c["stdout"], c["stderr"]) for c in found}


def line(out: str, tag: str) -> dict:
    return json.loads(next(x for x in out.splitlines() if x.startswith(tag + " "))[len(tag) + 1:])


DISPATCH_FLAGS = ("--model-path", "/models/qwen", "--host", "127.0.0.2", "--port", "31234",
                  "--disaggregation-bootstrap-port", "31235", "--disaggregation-transfer-backend", "mooncake_tcp",
                  "--disaggregation-ib-device", "mlx5_0", "--tp-size", "1", "--log-level", "warning",
                  "--embedding-cache-buffer-size", "40", "--resume-timeout", "7", "--max-queued-requests", "12",
                  "--staging-bytes", "1000000", "--queue-timeout", "4.5", "--allowed-media-domains", "img.example",
                  "--allowed-local-media-path", "/srv/a", "--allowed-local-media-path", "/srv/b",
                  "--device", "cpu", "--transfer-only")
LANGUAGE_MODES = {"mode": ("--disaggregation-mode", "language"), "language_only": ("--language-only",),
                  "mode=": ("--disaggregation-mode=language",)}
SGLANG_MODES = ("null", "prefill", "decode")


# What the plugin gives SGLang's PD roles on a CPU where the user set nothing (sglang_ext/pd.py)
PD_CPU_FLAGS = ("--attention-backend", "torch_native", "--device", "cpu", "--sleep-on-idle")
RETRACTION_ON_CPU = ("--disaggregation-decode-retraction-backup", "cpu_tensor")


def sglang_mode_argv(mode: str) -> tuple[str, ...]:
    """SGLang's own modes with every flag the plugin would default on a CPU given."""
    given = {"null": (), "prefill": (*PD_CPU_FLAGS, "--max-total-tokens", "32768"),
             "decode": (*PD_CPU_FLAGS, "--max-total-tokens", "32768", *RETRACTION_ON_CPU)}[mode]
    return "--model-path", "/models/llm", "--disaggregation-mode", mode, "--port", "30001", *given


def pd_argv(checkpoint: str, role: str) -> tuple[str, ...]:
    return "--model-path", checkpoint, "--disaggregation-mode", role, "--port", "30001"


@pytest.fixture(scope="module")
def checkpoint(seeded_checkpoint) -> str:
    """A whole seeded model: the encode side reads its tower, the language side its language model."""
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def parsed(checkpoint) -> dict[str, Parsed]:
    """Every command line the tests below parse, through SGLang with the plugin, in one process."""
    cases = {f"dispatch-{mode}": ("--disaggregation-mode", mode, *DISPATCH_FLAGS) for mode in ("encode", "language")}
    cases |= {"encoder-only": ("--model-path", checkpoint, "--encoder-only", "--port", "31240"),
              "encode-without-model": ("--disaggregation-mode", "encode", "--port", "31242"),
              "receiver": ("--language-only", "--hidden-size", "1024", "--checkpoint-dir", "/srv/ckpt"),
              "sglang-flag-without-model": ("--disaggregation-mode", "encode", "--enable-metrics"),
              "nixl": ("--model-path", "/m", "--disaggregation-mode", "encode", "--disaggregation-transfer-backend",
                       "nixl"),
              "bogus": ("--model-path", "/m", "--disaggregation-mode", "bogus")}
    cases |= {f"default-{name}": ("--model-path", checkpoint, *mode, "--encoder-urls", "http://10.0.0.1:30001", "--port",
                                  "31241", "--embedding-cache-buffer-size", "40") for name, mode in LANGUAGE_MODES.items()}
    cases |= {f"sglang-{mode}": sglang_mode_argv(mode) for mode in SGLANG_MODES}
    cases |= {f"pd-{role}": pd_argv(checkpoint, role) for role in PD_ROLES}
    return parse_all(cases)


@pytest.fixture(scope="module")
def parsed_without_plugin(checkpoint) -> dict[str, Parsed]:
    """SGLang's own modes without the plugin; its PD roles with the CPU defaults written out."""
    kv = ("--max-total-tokens", str(cpu_kv_tokens(checkpoint).tokens))
    cases = {f"sglang-{mode}": sglang_mode_argv(mode) for mode in SGLANG_MODES}
    cases |= {f"pd-{role}": (*pd_argv(checkpoint, role), *PD_CPU_FLAGS, *kv,
                             *(RETRACTION_ON_CPU if role == "decode" else ())) for role in PD_ROLES}
    return parse_all(cases, plugins="none-at-all")


def test_help_lists_our_modes_and_flags_with_defaults_and_pool_bytes() -> None:
    """Through our old launcher's name, which execs SGLang's (the fast test below): one process
    tells both that SGLang's launcher lists our modes and flags and that the alias runs it."""
    res = subprocess.run([sys.executable, "-m", "sglang_ext.launch_server", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "--disaggregation-mode {null,prefill,decode,encode,language}" in out
    assert "default 512 = 449 MiB at hidden 3584 bfloat16" in re.sub(r"\s+", " ", out)
    for flag in ("--embedding-cache-buffer-size", "--multimodal-block-size", "--checkpoint-dir",
                 "--queue-while-sleeping", "--resume-timeout", "--staging-bytes", "--queue-timeout",
                 "--max-queued-requests", "--allowed-local-media-path", "--allowed-media-domains",
                 "--allow-private-media-urls", "--max-image-pixels", "--transfer-only",
                 "--disaggregation-bootstrap-port", "--disaggregation-transfer-backend", "--disaggregation-ib-device",
                 "--model-path", "--tp-size", "SGLANG_EMBEDDING_DEFAULT_ALLOCATE_BUFFER_SIZE"):
        assert flag in out


@pytest.mark.parametrize("mode", ["encode", "language"])
def test_our_modes_dispatch_with_the_flags_sglang_parsed(parsed, mode: str) -> None:
    res = parsed[f"dispatch-{mode}"]
    assert res.returncode == 0, res.stderr[-2000:]
    args = line(res.stdout, "WORKER")
    assert "SGLANG " not in res.stdout  # SGLang's own server never started
    assert {k: args[k] for k in (
        "disaggregation_mode", "model_path", "host", "port", "disaggregation_bootstrap_port",
        "disaggregation_ib_device", "tp_size", "log_level", "mooncake_protocol", "embedding_cache_buffer_size",
        "resume_timeout", "max_queued_requests", "staging_bytes", "queue_timeout", "allowed_media_domains",
        "allowed_local_media_path", "device", "transfer_only")} == {
        "disaggregation_mode": mode, "model_path": "/models/qwen", "host": "127.0.0.2", "port": 31234,
        "disaggregation_bootstrap_port": 31235, "disaggregation_ib_device": "mlx5_0", "tp_size": 1,
        "log_level": "warning", "mooncake_protocol": "tcp", "embedding_cache_buffer_size": 40, "resume_timeout": 7.0,
        "max_queued_requests": 12, "staging_bytes": 1000000, "queue_timeout": 4.5,
        "allowed_media_domains": ["img.example"], "allowed_local_media_path": ["/srv/a", "/srv/b"],
        "device": "cpu", "transfer_only": True}


def test_upstream_epd_flags_are_aliases_of_our_modes(parsed) -> None:
    """``--encoder-only`` starts our encode worker (``--language-only``: SGLang's server, below)."""
    encode = parsed["encoder-only"]
    assert encode.returncode == 0, encode.stderr[-2000:]
    assert line(encode.stdout, "WORKER")["disaggregation_mode"] == "encode" and "SGLANG " not in encode.stdout


def test_workers_without_a_checkpoint_start_through_sglangs_launcher_on_our_flags(parsed) -> None:
    """The transfer-only receiver needs no model, and an encode worker without one is refused by our
    own launcher (test_workers): SGLang's parser (which requires one) is not asked; our parser takes
    every flag, and refuses one only SGLang's server has."""
    encode = line(parsed["encode-without-model"].stdout, "WORKER")
    assert (encode["disaggregation_mode"], encode["port"], encode["model_path"]) == ("encode", 31242, None)
    receiver = line(parsed["receiver"].stdout, "WORKER")
    assert (receiver["disaggregation_mode"], receiver["hidden_size"], receiver["checkpoint_dir"]) == (
        "language", 1024, "/srv/ckpt")
    refused = parsed["sglang-flag-without-model"]
    assert refused.returncode == 2 and "unrecognized arguments: --enable-metrics" in refused.stderr
    assert "WORKER " not in refused.stdout and "SGLANG " not in refused.stdout


@pytest.mark.parametrize("mode", list(LANGUAGE_MODES))
def test_the_language_mode_is_sglangs_own_server_by_default(parsed, mode) -> None:
    """With a model, our language mode is SGLang's server in its language-only mode, with the
    transfer backend our receiver takes the place of; SGLang validated the flags itself."""
    res = parsed[f"default-{mode}"]
    assert res.returncode == 0, res.stderr[-2000:]
    assert "WORKER " not in res.stdout  # our own engine never started
    sglang = line(res.stdout, "SGLANG")
    assert {k: sglang[k] for k in ("language_only", "encoder_transfer_backend", "encoder_urls", "disaggregation_mode",
                                    "port", "device", "attention_backend")} == {
        "language_only": "True", "encoder_transfer_backend": "'zmq_to_tokenizer'",
        "encoder_urls": "['http://10.0.0.1:30001']", "disaggregation_mode": "'null'", "port": "31241",
        "device": "'cpu'", "attention_backend": "'torch_native'"}


def test_on_a_cpu_small_requests_do_not_wait_for_big_ones(parsed) -> None:
    """On a CPU our language mode gives SGLang's scheduler the flags of docs/scheduling.md: it
    sleeps while idle instead of spinning a core the encoders need, and running requests decode
    within every prefill chunk instead of waiting out a long prompt's chunks."""
    sglang = line(parsed["default-mode"].stdout, "SGLANG")
    assert {k: sglang[k] for k in ("sleep_on_idle", "enable_mixed_chunk")} == {
        "sleep_on_idle": "True", "enable_mixed_chunk": "True"}


def test_the_language_mode_hashes_embeddings_outside_the_scheduler(parsed) -> None:
    """SGLang hashes an item's embedding (its radix-cache key) in the scheduler's loop, stalling
    every decoding stream, unless SGLANG_MM_PRECOMPUTE_HASH moves it to the tokenizer manager's
    threads: our language mode sets it; SGLang's own modes are left as they are."""
    for mode in LANGUAGE_MODES:
        assert line(parsed[f"default-{mode}"].stdout, "ENV") == {"SGLANG_MM_PRECOMPUTE_HASH": "1"}
    for mode in SGLANG_MODES:
        assert line(parsed[f"sglang-{mode}"].stdout, "ENV") == {"SGLANG_MM_PRECOMPUTE_HASH": None}


@pytest.mark.fast
def test_our_old_launcher_is_an_alias_of_sglangs(monkeypatch) -> None:
    from sglang_ext import launch_server as alias

    execs = []
    monkeypatch.setattr(alias.os, "execv", lambda path, argv: execs.append((path, argv)))
    monkeypatch.setattr(sys, "argv", ["launch_server.py", "--disaggregation-mode", "encode", "--port", "30001"])
    alias.main()
    assert execs == [(sys.executable, [sys.executable, "-m", "sglang.launch_server", "--disaggregation-mode", "encode",
                                       "--port", "30001"])]


def test_unsupported_backend_in_our_modes_is_a_clear_error(parsed) -> None:
    res = parsed["nixl"]
    assert res.returncode == 1
    assert "--disaggregation-transfer-backend nixl is not supported" in res.stderr


@pytest.mark.parametrize("mode", SGLANG_MODES)
def test_sglang_modes_parse_exactly_as_without_the_plugin(parsed, parsed_without_plugin, mode: str) -> None:
    with_plugin, without = parsed[f"sglang-{mode}"], parsed_without_plugin[f"sglang-{mode}"]
    assert with_plugin.returncode == without.returncode == 0, with_plugin.stderr[-2000:]
    assert line(with_plugin.stdout, "SGLANG") == line(without.stdout, "SGLANG")
    assert "WORKER " not in with_plugin.stdout


@pytest.mark.parametrize("role", PD_ROLES)
def test_sglangs_pd_roles_get_the_cpu_path_on_a_cpu(parsed, parsed_without_plugin, role: str) -> None:
    """A prefill or decode started with nothing set parses as SGLang without the plugin parses the
    same command with the CPU defaults written out (the retraction backup in plain tensors on the
    decode, the CPU backend and device, a KV pool sized to the machine)."""
    with_plugin, without = parsed[f"pd-{role}"], parsed_without_plugin[f"pd-{role}"]
    assert with_plugin.returncode == without.returncode == 0, with_plugin.stderr[-2000:]
    assert line(with_plugin.stdout, "SGLANG") == line(without.stdout, "SGLANG")
    assert "WORKER " not in with_plugin.stdout


def test_an_invalid_mode_is_still_rejected_by_sglang(parsed) -> None:
    res = parsed["bogus"]
    assert res.returncode == 2
    assert "invalid choice: 'bogus'" in res.stderr and "'encode'" in res.stderr


@pytest.mark.fast
def test_unsupported_sglang_version_gives_one_clear_error(monkeypatch) -> None:
    import sglang_ext.plugin as plugin

    monkeypatch.setattr(plugin.metadata, "version", lambda _name: "0.5.9")
    monkeypatch.setattr(sys, "argv", ["x", "--disaggregation-mode", "encode"])
    with pytest.raises(SystemExit, match=r"SGLang 0.5.9 is installed; epd-resume supports sglang>=0.5.21,<0.6"):
        plugin.register()
    monkeypatch.setattr(sys, "argv", ["x", "--disaggregation-mode", "prefill"])
    plugin.register()  # other modes: a logged error, SGLang goes on without our hooks
    assert plugin.supported_version("0.5.23") and plugin.supported_version("0.5.21.post1")
    assert not plugin.supported_version("0.6.0") and not plugin.supported_version("0.5.20")


@pytest.mark.serial
def test_the_plugin_costs_nothing_in_other_sglang_processes() -> None:
    """``register()`` in a process of another mode imports none of our modules (nor torch or
    transformers anew); its CPU time (which a cold page cache or a busy machine does not add to)
    is about 6 ms here, where importing the connector and the language worker would take about
    230 ms: the bound lies between, 16 times the first."""
    code = ("import sys, time, sglang.srt.server_args\n"
            "before = set(sys.modules)\n"
            "t = time.process_time()\n"
            "from sglang_ext.plugin import register\n"
            "register()\n"
            "print(round((time.process_time() - t) * 1000, 2), sorted(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split(" ", 1)
    millis, new_modules = float(out[0]), out[1]
    assert millis < 100, f"register() took {millis} ms of CPU"
    assert not re.search(r"'(connector|embedding_side|language_side|torch|transformers|sglang_ext\.args)\b", new_modules)


# A CPU without bf16 arithmetic is emulated; this machine's own case is tested too where it differs.
CPUS = ["without bf16 arithmetic"] + (["this one, with bf16 arithmetic"] if not slow_bf16() else [])


@pytest.mark.parametrize("cpu", CPUS)
def test_on_a_cpu_without_bf16_arithmetic_sglangs_linear_layers_compute_in_float32(cpu: str) -> None:
    """In a process that loaded the plugins as SGLang's launcher does (every mode: SGLang's own
    monolithic server too, so a benchmark's two sides compute alike), SGLang's unquantized linear
    layers take ``sglang_ext.cpu.gemm``'s product for many rows on a CPU without bf16 arithmetic
    (AVX2; emulated here by PyTorch's two capability checks answering no), and PyTorch's bf16
    kernel for few rows; on a CPU with it (AVX512-BF16 or AMX) PyTorch's kernel for all. On a
    machine without it, its own case is the emulated one, run once."""
    emulate = ("torch.cpu._is_avx512_bf16_supported = torch.cpu._is_amx_tile_supported = lambda: False\n"
               if cpu == "without bf16 arithmetic" else "")
    code = ("import json, torch, torch.nn.functional as F\n"
            f"{emulate}"
            "from sglang.srt.plugins import load_plugins\n"
            "load_plugins()\n"
            "from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod\n"
            "from sglang_ext.cpu import gemm as cpu_gemm\n"
            "calls, product = [], cpu_gemm.linear\n"
            "cpu_gemm.linear = lambda x, *rest: calls.append(x.shape[0]) or product(x, *rest)\n"
            "layer = torch.nn.Module()\n"
            "layer.weight = torch.nn.Parameter(torch.randn(80, 96).bfloat16(), requires_grad=False)\n"
            "x = torch.randn(128, 96).bfloat16()\n"
            "many, few = (UnquantizedLinearMethod().apply(layer, rows) for rows in (x, x[:8]))\n"
            "print(json.dumps({'slow_bf16': cpu_gemm.slow_bf16(), 'calls': calls,\n"
            "                  'many_float32': torch.equal(many, F.linear(x.float(), layer.weight.float()).bfloat16()),\n"
            "                  'many_bf16_kernel': torch.equal(many, F.linear(x, layer.weight)),\n"
            "                  'few_bf16_kernel': torch.equal(few, F.linear(x[:8], layer.weight))}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if seen["slow_bf16"]:
        assert seen["calls"] == [128] and seen["many_float32"] and seen["few_bf16_kernel"], seen
    else:
        assert seen["calls"] == [] and seen["many_bf16_kernel"] and seen["few_bf16_kernel"], seen
    if cpu == "without bf16 arithmetic":
        assert seen["slow_bf16"]
