#!/bin/bash
# Alternating runs of two trees' turnstore_bench.py over the same store (bench/README.md,
# "The index pointing at row groups"):
#   bench/turnstore_rounds.sh STORE_DIR ROUNDS [bench options]
# BASE: the baseline tree (git -C MAIN archive COMMIT kvobs bench | tar -x -C BASE, with
# this bench script and tests/data/demo-spans.otlp.jsonl copied in); TREE: this one.
STORE=$1; ROUNDS=$2; shift 2
BASE=${BASE:-/tmp/base_lookup}
TREE=${TREE:-$(cd "$(dirname "$0")/.." && pwd)}
PYTHON=${PYTHON:-python}
for r in $(seq 1 "$ROUNDS"); do
  for tree in "$BASE" "$TREE"; do
    echo "== round $r tree $tree load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%H:%M:%S)"
    (cd "$tree" && "$PYTHON" bench/turnstore_bench.py --conversations 1000000 --dir "$STORE" \
        --baseline 0 "$@" 2>&1 | grep -v "^store")
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%H:%M:%S)"
