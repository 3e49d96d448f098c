# Engine + router image: `epdctl serve` (role pools) and `epdctl router`, in two variants:
#   docker build -f docker/engine.Dockerfile -t epd-engine:0.1.0 .                         # cpu
#   docker build -f docker/engine.Dockerfile --build-arg VARIANT=gpu -t epd-engine-gpu:0.1.0 .
# torch from PyPI is its CUDA 13.0 build (PyPI has no CPU-only wheel), so both run on CPU
# (--device cpu) and on a GPU; the gpu variant adds the `gpu` extra (FlashInfer with its kernels
# built in, CuPy for NCCL, NVML) and needs an NVIDIA driver >= 580 (docs/gpu.md).
# BASE: any image with python3 >= 3.11 and its venv module (default: the public Python image;
# CI passes a Debian base bootstrapped locally). Dependencies go into a virtual environment,
# so a distribution Python that refuses system-wide pip installs (PEP 668) works too.
ARG BASE=python:3.12-slim
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/epd PATH=/opt/epd/bin:$PATH
WORKDIR /app
RUN python3 -m venv /opt/epd

# VARIANT=gpu, first: FlashInfer's kernels, compiled here with a toolchain the same step removes
# (tools/images/gpu_kernels.sh), on torch and FlashInfer pinned by requirements-gpu-build.lock
# alone, so a change elsewhere in the locks (or the code) rebuilds no kernel; then the rest of
# the `gpu` extra (requirements-gpu.lock: CuPy, NVML, NIXL). The cpu variant skips both.
ARG VARIANT=cpu
# gpu: the GPU generations the kernels are built for (empty: 8.0 9.0 10.0 12.0, i.e.
# A100/A10/L4/L40, H100/H200, B200/B300, RTX PRO 6000/RTX 50; tools/images/flashinfer_aot.py)
ARG CUDA_ARCHS=
COPY requirements-gpu-build.lock tools/images/gpu_kernels.sh tools/images/flashinfer_aot.py ./
RUN case "$VARIANT" in \
      cpu) ;; \
      gpu) sh gpu_kernels.sh ;; \
      *) echo "VARIANT is cpu or gpu, not $VARIANT" >&2; exit 1 ;; \
    esac
COPY requirements-gpu.lock ./
RUN if [ "$VARIANT" = gpu ]; then pip install --no-deps -r requirements-gpu.lock; fi

# Every pinned dependency (on the gpu variant, the packages above are already there): this
# layer stays cached until a lock changes (README or code edits do not invalidate it).
COPY requirements.lock ./
RUN pip install --no-deps -r requirements.lock

COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY operator/ operator/
RUN pip install --no-deps . && epdctl --help >/dev/null

# /models: the model volume's mount point; pods mount it (or an emptyDir for presets), so the
# root filesystem can be read-only.
RUN useradd --uid 10001 --create-home epd && mkdir -p /models && chown epd /models
USER 10001
EXPOSE 8000 8080
ENTRYPOINT []
CMD ["epdctl", "--help"]
