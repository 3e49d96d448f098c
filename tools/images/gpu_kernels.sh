#!/bin/sh
# The GPU engine image's kernel step (docker/engine.Dockerfile, VARIANT=gpu), run as root into
# the virtual environment $VIRTUAL_ENV before any other dependency:
#   1. requirements-gpu-build.lock: torch and FlashInfer at the versions of the other locks,
#      plus nvcc 13.0 and its headers from PyPI (at torch's CUDA version);
#   2. FlashInfer's kernels the engine runs, compiled ahead of time into FlashInfer's AOT
#      directory (flashinfer_aot.py) with the distribution's g++ as nvcc's host compiler;
#   3. the compiler toolchain removed again in this same step, so the layer holds torch,
#      FlashInfer and the kernels: a pod loads them and compiles nothing at start.
# CUDA_ARCHS (the Dockerfile's build argument; empty: flashinfer_aot.py's DEFAULT_ARCHS) picks
# the GPU generations the kernels are built for, e.g. --build-arg CUDA_ARCHS=9.0 for H100/H200
# only (a quarter of the build time).
set -eu
# nvcc and what only it needs: uninstalled below (tests/images/test_dockerfiles.py checks these
# are exactly the build lock's packages that no other lock has).
TOOLCHAIN="nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm nvidia-cuda-cccl"
if [ -n "${CUDA_ARCHS:-}" ]; then export FLASHINFER_CUDA_ARCH_LIST="$CUDA_ARCHS"; fi
pip install --no-deps -r requirements-gpu-build.lock

# nvcc, its headers and libdevice sit beside the CUDA libraries torch installed, so nvidia/cu13
# is a whole CUDA_HOME (bin/nvcc, include/ with cuBLAS's headers, lib/).
cuda_home="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
ln -s lib "$cuda_home/lib64"
ln -s libcudart.so.13 "$cuda_home/lib/libcudart.so"

# A host compiler for nvcc (Debian, or the python image's Debian base).
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends g++ >/dev/null
# FlashInfer links every module with -lcuda (the driver, which the GPU node provides); an empty
# stub satisfies the linker and --as-needed drops it from modules that call no driver function,
# so the kernels load on a CPU too (flashinfer_aot.py check, tests/images/test_gpu_image.py).
mkdir -p "$cuda_home/lib/stubs"
gcc -shared -x c /dev/null -o "$cuda_home/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
start=$(date +%s)
CUDA_HOME="$cuda_home" CXX="c++ -Wl,--as-needed" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  HOME=/tmp/flashinfer-build python flashinfer_aot.py build
echo "flashinfer kernels: $(($(date +%s) - start)) s"
python flashinfer_aot.py check

# Remove the toolchain: nvcc, its headers, the stub, g++ and the build tree.
# shellcheck disable=SC2086
pip uninstall -y -q $TOOLCHAIN
rm -rf "$cuda_home/lib64" "$cuda_home/lib/libcudart.so" "$cuda_home/lib/stubs" /tmp/flashinfer-build
apt-get purge -y -qq --auto-remove g++ >/dev/null
rm -rf /var/lib/apt/lists/* /root/.cache
