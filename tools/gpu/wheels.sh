#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, into the ignored .whl/ that run-checks.sh installs from
# (docs/gpu.md, "Running the checks on a GPU machine"). That machine has Python 3.12, torch,
# CuPy, NCCL and transformers 5 but not the engine's server stack, the openai client,
# FlashInfer or NIXL; versions come from requirements.lock / requirements-gpu.lock.
# transformers, tokenizers and huggingface-hub are the lock's too, so the tests run what the
# images ship. The whole call may carry 64 MiB: NIXL's wheel (59 MB) is repacked without its
# expert-parallel kernels (built for other torch versions) and plugins the engine never
# loads (only UCX is), which leaves it at 24 MB and the set at about 57 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
PACKAGES=(annotated-types apache-tvm-ffi fastapi flashinfer-python httptools pydantic
  pydantic-core starlette typing-inspection uvicorn opentelemetry-api openai jiter sniffio
  httpx2 httpcore2 truststore transformers tokenizers huggingface-hub nixl-cu13 setproctitle)
pinned() {  # NAME -> NAME==VERSION from the locks
  local line
  line=$(grep -h -m1 -i "^$1==" requirements-gpu.lock requirements.lock | head -1)
  [ -n "$line" ] || { echo "$1 is in neither lock" >&2; exit 1; }
  echo "$line"
}
specs=()
for name in "${PACKAGES[@]}"; do specs+=("$(pinned "$name")"); done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"

python3 tools/gpu/repack_nixl.py .whl/nixl_cu13-*.whl
du -sh .whl
