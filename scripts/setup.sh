#!/usr/bin/env bash
# Fresh-machine setup: Debian's libibverbs1 (Mooncake's TCP transport links it), iproute2 and
# iptables (the tests' simulated hosts: harness/hosts.py), then a virtual environment at .venv
# with this package and its extras under the CPU pins, AIPerf in .venv-aiperf and GuideLLM in
# .venv-guidellm.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ldconfig -p | grep -q 'libibverbs\.so\.1 ' || ! command -v ip >/dev/null || ! command -v tc >/dev/null \
        || ! command -v iptables >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 iproute2 iptables >/dev/null
fi

# AIPerf (NVIDIA's benchmark client; a test drives it as a user would) in an environment of its
# own, since its pins (transformers, numpy) are not ours; installed beside the rest.
( [ -x .venv-aiperf/bin/aiperf ] || { python3 -m venv .venv-aiperf \
    && .venv-aiperf/bin/python -m pip install -q --disable-pip-version-check "aiperf==0.13.0"; } ) &
AIPERF_INSTALL=$!
# GuideLLM likewise (its data loader needs torch: the CPU wheel, pinned as ours is).
( [ -x .venv-guidellm/bin/guidellm ] || { python3 -m venv .venv-guidellm \
    && .venv-guidellm/bin/python -m pip install -q --disable-pip-version-check "guidellm[vision]==0.8.1" \
        "torch==2.13.0"; } ) &
GUIDELLM_INSTALL=$!

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints-cpu.txt \
    -e ".[mooncake,encoder,video,dev]"
# SGLang for the plugin: its wheel without dependencies, then the short list it needs here.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "$(grep '^sglang==' requirements-sglang-cpu.txt)"
# (SGLang's full requirement list is deliberately not installed: no resolver report about it.)
grep -v '^sglang==' requirements-sglang-cpu.txt | .venv/bin/python -m pip install -q --disable-pip-version-check \
    --no-warn-conflicts -c constraints-cpu.txt -r /dev/stdin
# No GPU: torchvision's wheel (SGLang's Qwen-VL processor imports it) is a CUDA build whose C ops
# do not load here, and sgl_kernel has no CPU build. sglang_ext/cpu/shim.py stands in for what
# SGLang touches of them; a .pth file loads it in every process of this environment.
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "torchvision==0.28.0"
    echo "import sglang_ext.cpu.shim" > "$SITE/epd_cpu_shim.pth"
else
    rm -f "$SITE/epd_cpu_shim.pth"
fi
.venv/bin/python -c "import mooncake.engine, torch, transformers, connector, sglang.srt.plugins, torchvision, fastapi" \
    || { echo "setup failed: the environment does not import" >&2; exit 1; }
wait "$AIPERF_INSTALL" && .venv-aiperf/bin/aiperf --version >/dev/null \
    || { echo "setup failed: AIPerf did not install in .venv-aiperf" >&2; exit 1; }
wait "$GUIDELLM_INSTALL" && .venv-guidellm/bin/guidellm --help >/dev/null \
    || { echo "setup failed: GuideLLM did not install in .venv-guidellm" >&2; exit 1; }
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
