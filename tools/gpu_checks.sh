#!/usr/bin/env bash
# GPU checks, in one go. First the device check (tools/device_check.py: tables, learning
# slices, ranking with every model and precision, re-ranking, the host round-trip count and
# the out-of-memory paths, in one process, bounded to 8 minutes; it needs only this host's
# Python and torch, plus the wheels in artifacts/device-wheels where a module is missing).
# Then, where this Python also has the broker's and Redis' clients (confluent-kafka, faust,
# redis), the checks that run a worker against the embedded stack: that a learning slice and
# a serving batch copy nothing back to the host but the gradient batch, recall's candidates
# and the reply (tools/gpu_sync_check.py, under torch.cuda.set_sync_debug_mode), the tests
# that drive the worker (its tables, vector search and ranking then run on CUDA:
# FRESHREC_DEVICE defaults to auto), and the serving benchmarks' GPU figures beside the same
# host's CPU ones. Needs a CUDA build of torch and a GPU; each step is bounded
# (STEP_TIMEOUT_S, 900 s by default).
#
#   tools/gpu_checks.sh [OUT_DIR]          # default: artifacts/gpu
#   PYTHON=/path/to/python tools/gpu_checks.sh   # default: .venv/bin/python, else python3
#
# Writes OUT_DIR/device_check.json, and with the stack's clients sync_check.log, pytest.log,
# bench_ann_cuda.json, bench_serving_cuda.json, bench_serving_cpu.json, bench_ranking.json,
# bench_precision.json (float32 against float16 tables and ranking weights: device bytes per
# 1M rows, recall, learning slice and ranking batch times, AUC) and a log of each step; exits
# non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
OUT=${1:-artifacts/gpu}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-900}
mkdir -p "$OUT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_checks: torch sees no CUDA device here ($PY); nothing to check" >&2
  exit 2
fi
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/device.txt"
failed=0
step() {  # step NAME COMMAND...: run (bounded), log, keep going
  local name=$1; shift
  echo "== $name"
  if ! timeout "$STEP_TIMEOUT_S" "$@" >"$OUT/$name.log" 2>&1; then
    echo "   failed (see $OUT/$name.log)"; failed=1
  fi
  tail -n 3 "$OUT/$name.log"
}
# bounds itself to 8 minutes (exit 3 past that, its JSON written so far)
step device_check "$PY" tools/device_check.py --out "$OUT/device_check.json"
if ! "$PY" -c 'import confluent_kafka, faust, redis' 2>/dev/null; then
  echo "== the rest skipped: $PY lacks confluent-kafka, faust or redis (the embedded stack's"
  echo "   clients); the device check above is what runs on such a host"
  exit $failed
fi
step sync_check "$PY" -m tools.gpu_sync_check
# the kafkajs interop test needs node and npm, not a GPU
step pytest "$PY" -m pytest -q -p no:cacheprovider -k "not kafkajs" \
  tests/test_learning_unit.py tests/test_serving_unit.py tests/test_rankers_unit.py tests/test_learning_e2e.py tests/test_serving_e2e.py \
  tests/test_host_syncs.py
step bench_ann_cuda "$PY" -m tools.bench_ann --device cuda --items 200000,1000000,5000000
cp artifacts/bench_ann.json "$OUT/bench_ann_cuda.json" 2>/dev/null
step bench_serving_cuda "$PY" -m tools.bench_serving --device cuda --parts ranking,recall,serve,batching \
  --models "$OUT/models"
cp artifacts/bench_serving.json "$OUT/bench_serving_cuda.json" 2>/dev/null
step bench_serving_cpu "$PY" -m tools.bench_serving --device cpu --parts ranking,recall,serve \
  --models "$OUT/models"
cp artifacts/bench_serving.json "$OUT/bench_serving_cpu.json" 2>/dev/null
# every ranking model (attention included) on the GPU, from a small training run
step bench_ranking_cuda "$PY" -m tools.bench_ranking --device cuda --impressions 50000 \
  --out "$OUT" --models "$OUT/ranking-models"
# float32 against float16 storage on the GPU: the allocator's bytes for 1M item rows
step bench_precision_cuda "$PY" -m tools.bench_precision --device cuda --items 1000000 --out "$OUT"
exit $failed
