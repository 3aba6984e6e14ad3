#!/usr/bin/env bash
# GPU checks, in one go: that a learning slice and a serving batch copy nothing back to the
# host but the gradient batch, recall's candidates and the reply (tools/gpu_sync_check.py,
# under torch.cuda.set_sync_debug_mode), the tests that drive the worker (its tables, vector
# search and ranking then run on CUDA: FRESHREC_DEVICE defaults to auto), and the serving
# benchmarks' GPU figures beside the same host's CPU ones. Needs a CUDA build of torch and a GPU.
#
#   tools/gpu_checks.sh [OUT_DIR]          # default: artifacts/gpu
#   PYTHON=/path/to/python tools/gpu_checks.sh
#
# Writes OUT_DIR/sync_check.log, pytest.log, bench_ann_cuda.json, bench_serving_cuda.json,
# bench_serving_cpu.json, bench_ranking.json, bench_precision.json (float32 against float16
# tables and ranking weights: device bytes per 1M rows, recall, learning slice and ranking batch
# times, AUC) and a log of each step; exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-artifacts/gpu}
mkdir -p "$OUT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_checks: torch sees no CUDA device here ($PY); nothing to check" >&2
  exit 2
fi
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/device.txt"
failed=0
step() {  # step NAME COMMAND...: run, log, keep going
  local name=$1; shift
  echo "== $name"
  if ! "$@" >"$OUT/$name.log" 2>&1; then echo "   failed (see $OUT/$name.log)"; failed=1; fi
  tail -n 3 "$OUT/$name.log"
}
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
