#!/usr/bin/env bash
# Every GPU check of issue 18 in one pass, for a lent GPU machine (see docs/gpu.md):
# correctness first (gpu-marked tests), then the figures (bench-gpu, transfer pulls).
# Each step has its own time limit and a failed step does not stop the next; results go
# to $OUT (or ./gpu-out). Python packages the machine lacks come from .whl/ (wheels for
# its Python: .whl/*.whl plus .whl/cpXY/*.whl).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3
pyver=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl/"$pyver"/*.whl 2>&1 | tail -3
fi
export PYTHONPATH=/tmp/site:$PWD/engine:$PWD/operator:$PWD

step() {  # step NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, report its exit status
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  $PY -c 'import sys, torch, cupy; print(sys.version.split()[0], torch.__version__, cupy.__version__)'
  nvcc --version | tail -1; nproc; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# FlashInfer compiles its kernels on first use (nvcc): start that now, beside the tests.
if [ -f tools/gpu/flashinfer_warm.py ]; then
  timeout 300 $PY tools/gpu/flashinfer_warm.py >"$OUT/flashinfer-warm.log" 2>&1 &
  warm_pid=$!
fi

TAIL=25 step pytest-gpu 300 $PY -m pytest -q -o addopts="" -p no:cacheprovider -m gpu -rs \
  --timeout 240 ${GPU_TESTS:-tests/engine}

if [ -n "${warm_pid:-}" ]; then
  wait "$warm_pid"; echo "== flashinfer-warm: rc=$?" | tee -a "$OUT/steps.txt"
  tail -5 "$OUT/flashinfer-warm.log"
fi

TAIL=12 step bench-gpu 240 $PY -m epd_engine bench-gpu --out "$OUT/gpu.json"
if [ -n "${BENCH_TRANSFER:-}" ]; then
  TAIL=20 step bench-transfer-gpu 180 bash -c "$BENCH_TRANSFER"
fi
cat "$OUT/steps.txt"
