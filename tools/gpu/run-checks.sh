#!/usr/bin/env bash
# Every GPU check of issue 18 in one pass, for a lent GPU machine (docs/gpu.md): the gpu
# tests, then the figures (bench-gpu with each attention backend, transfer pulls). Each step
# has its own time limit and a failed step does not stop the next. Output: $OUT/all.log, the
# JSON of each bench, FlashInfer's compile log. STEPS="tests served" runs only the steps
# named (default: all of them). Packages the machine lacks come from .whl/
# (wheels for any Python in .whl/*.whl, compiled ones in .whl/cpXY/).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
LOG=$OUT/all.log
export PYTHONUNBUFFERED=1 EPD_REAL_NODE=0
PY=${PY:-python3}
pyver=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ "${WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  shopt -s nullglob
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl/"$pyver"/*.whl >>"$LOG" 2>&1 || echo "wheels: pip failed"
  shopt -u nullglob
fi
export PYTHONPATH=/tmp/site:$PWD/engine:$PWD/operator:$PWD
# FlashInfer kernels an earlier machine built (its ~/.cache/flashinfer as a tarball, carried
# in the ignored .fi/): the builds below then find them done.
if [ -f .fi/fi-cache.tgz ]; then tar xzf .fi/fi-cache.tgz -C "$HOME"; fi

# DEADLINE_S: seconds from the start after which no step runs; each step's limit is cut to
# what is left (a lease is short: the steps come in the order that matters).
DEADLINE_S=${DEADLINE_S:-100000}
step() {  # step NAME LIMIT_S COMMAND...: run it, append its output to all.log, show the tail
  local name=$1 limit=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  local left=$((DEADLINE_S - SECONDS - 5))
  if [ "$left" -lt 20 ]; then SUMMARY+="$name: not run (deadline)"$'\n'; return; fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  local start=$SECONDS
  echo "===== $name" >>"$LOG"
  timeout "$limit" "$@" >"/tmp/$name.log" 2>&1
  local rc=$?
  cat "/tmp/$name.log" >>"$LOG"
  SUMMARY+="$name: rc=$rc in $((SECONDS - start)) s"$'\n'
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n "${TAIL:-12}" "/tmp/$name.log"
}
SUMMARY=""

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch, cupy; print(sys.version.split()[0], torch.__version__, cupy.__version__)'
  nvcc --version | tail -1; echo "cpus: $(nproc)"; } 2>&1 | tee -a "$LOG"

# FlashInfer compiles its kernels with nvcc on first use: start that now, beside the tests.
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
timeout 330 $PY tools/gpu/flashinfer_warm.py >"$OUT/flashinfer-warm.log" 2>&1 &
warm_pid=$!
wanted() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }
# Issue 31's 7B Qwen shape (random weights, bf16), written beside the first tests.
if wanted qwen-7b; then
  ( $PY -m epd_engine make-model --preset qwen2-vl-7b --dtype bfloat16 /tmp/qwen2-vl-7b \
      >/tmp/make-qwen.log 2>&1; echo $? >/tmp/qwen-made ) &
fi

# The 7B LLaVA checkpoint the served, start-up and cost steps read, written beside them too
# (13.5 GB of random weights; once per machine).
if wanted make-7b && [ ! -f /tmp/llava-made ]; then
  ( $PY -m epd_engine make-model --preset llava-1.5-7b /tmp/llava-1.5-7b >/tmp/make-7b.log 2>&1
    echo $? >/tmp/llava-made ) &
fi

PYTEST=($PY -m pytest -q -o addopts= -p no:cacheprovider -m gpu -rs --timeout 200)
TAIL=20 step tests 200 "${PYTEST[@]}" -k "not nixl" tests/engine/model/test_gpu_parity.py \
  tests/engine/engine/test_engine_cuda.py tests/engine/transfer/test_gpu_backends.py \
  tests/engine/server/test_device_metrics.py
# Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Gemma 3 in the engine on CUDA: float32 tokens equal to
# the CPU's, bfloat16 close to them (issues 31 and 35).
TAIL=20 step families 200 "${PYTEST[@]}" -s tests/engine/engine/test_engine_cuda_families.py \
  tests/engine/engine/test_engine_cuda.py -k "families or qwen2_vl"
# Issue 31 on the released Qwen2-VL-7B shape in bf16 (28/4 heads): the attention backend auto
# picks, a 12.8 MP photo, start-up, activation peak against the plan's reserve, decode at
# batch 1 and 32 against the weights' HBM floor ($OUT/qwen-7b-probe.json).
TAIL=60 step qwen-7b 300 bash -c "while [ ! -f /tmp/qwen-made ]; do sleep 2; done; \
  cat /tmp/make-qwen.log | tail -3; $PY tools/gpu/qwen_7b_probe.py --model /tmp/qwen2-vl-7b \
  --profile-photo --compare-eager --out $OUT/qwen-7b-probe.json"
# Tensor parallelism's CUDA path on one GPU (issue 34): two ranks on it over gloo give one
# rank's tokens, LLaVA and Qwen2-VL tiny, float32 (NCCL needs a GPU per rank: not here).
TAIL=20 step tests-tp 200 "${PYTEST[@]}" tests/engine/parallel/test_tensor_parallel_tokens.py
# Every method through the router with the GPU transfer backends, against one EPD instance.
TAIL=20 step tests-methods 240 "${PYTEST[@]}" -k "not nixl" tests/engine/disagg/test_methods_gpu.py
# NIXL on GPU caches (issue 30; nixl-cu13 from .whl/cp311/ where the machine lacks it): pulls
# between two processes with UCX's own transports and with tcp,cuda_copy (what two pods
# without RDMA leave it), bytes exact, then E+P+D and ED+P through the router, tokens equal
# to one EPD instance's. Pull times against a device copy: bench-transfer-gpu below.
TAIL=20 step tests-nixl 300 "${PYTEST[@]}" -k nixl tests/engine/transfer/test_gpu_backends.py \
  tests/engine/disagg/test_methods_gpu.py
step bench-gpu-torch 150 $PY -m epd_engine bench-gpu --attention torch --out "$OUT/gpu-torch.json"
TAIL=16 step bench-transfer-gpu 150 $PY -m epd_engine.bench.transfer_gpu --out "$OUT/transfer-gpu.json"
# Issue 30: NIXL's fast path between two processes of one GPU. On the H200 (docs/gpu.md) UCX's
# peer error handling off alone left it at 0.8 GB/s; with CUDA IPC gets on as well it moved
# 130 GB/s. Which setting is needed was not separated: the gets alone (peer handling kept),
# then both; cuda_ipc beside each as the yardstick.
TAIL=16 step nixl-cuda-ipc-get 120 env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on $PY -m \
  epd_engine.bench.transfer_gpu --backends nixl,cuda_ipc --repeats 20 \
  --out "$OUT/transfer-gpu-nixl-get.json"
TAIL=16 step nixl-no-peer-errors 120 env EPD_NIXL_UCX_ERROR_MODE=none \
  UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on $PY -m epd_engine.bench.transfer_gpu \
  --backends nixl,cuda_ipc --repeats 20 --out "$OUT/transfer-gpu-nixl-none.json"
wait "$warm_pid"; SUMMARY+="flashinfer-warm: rc=$?"$'\n'; tail -4 "$OUT/flashinfer-warm.log"
TAIL=16 step tests-flashinfer 150 "${PYTEST[@]}" tests/engine/model/test_flashinfer_gpu.py \
  tests/engine/model/test_layer_ops.py tests/engine/bench/test_step_share.py
# Issue 15's step overhead: the share of a decode step outside the model, batch 256, 1,024-
# token contexts, Mistral-7B's shape cut to 2 layers, FlashInfer and decode graphs.
TAIL=30 step step-share 120 bash -c "$PY -m epd_engine make-model --preset tiny-llava \
  /tmp/tiny-llava && $PY -m epd_engine.bench.step_share --model /tmp/tiny-llava --device cuda \
  --out $OUT/step-share-gpu.json"
step bench-gpu-flashinfer 120 $PY -m epd_engine bench-gpu --attention flashinfer \
  --out "$OUT/gpu-flashinfer.json"
# Served tokens/s through one instance's OpenAI endpoint against transformers' generate, 7B
# shape, random weights (the checkpoint is written first, as for profile-costs below).
step make-7b 200 bash -c "while [ ! -f /tmp/llava-made ]; do sleep 2; done; \
  tail -3 /tmp/make-7b.log; exit \$(cat /tmp/llava-made)"
# The GPU image's FlashInfer (issue 30): its kernels built ahead of time (.fi/aot.tgz from the
# image by tools/images/export_aot.sh, else built here by the image's script), then one cold
# instance on the 7B shape with FlashInfer's JIT off and an empty HOME: start -> ready and time
# to first token, nothing compiled ($OUT/aot-cold-start.json; docs/gpu.md, "The GPU image").
TAIL=30 step aot-cold-start 420 $PY tools/gpu/aot_cold_start.py --model /tmp/llava-1.5-7b
TAIL=40 step served 330 $PY benchmarks/bench_served.py --model /tmp/llava-1.5-7b \
  --device cuda --batches 1 8 32 128 --rounds 3 --new-tokens 64 \
  --server-log "$OUT/served-server.log" --out "$OUT/served-gpu.json" ${SERVED_ARGS:-}
# The same, one instance with --async-scheduling against one without (both this tree).
TAIL=40 step served-async 330 $PY benchmarks/bench_served.py --model /tmp/llava-1.5-7b \
  --device cuda --new-tokens 64 ${ASYNC_ARGS:---batches 8 32 128 --rounds 3} \
  --after-args=--async-scheduling --before-args=--no-async-scheduling \
  --server-log "$OUT/served-server.log" --out "$OUT/served-gpu-async.json"
# The GPU cost model the planner reads (a random-weight 7B checkpoint is written first).
TAIL=8 step profile-costs 240 $PY -m epd_engine profile-costs --preset llava-1.5-7b \
  --model /tmp/llava-1.5-7b --device cuda --dtype ${PROFILE_DTYPE:-float16} \
  --num-kv-blocks 4096 --rounds 2 --no-progress --out "$OUT/cost-gpu.json"
echo "$SUMMARY" | tee -a "$LOG"
