# Engine + router image: `epdctl serve` (role pools) and `epdctl router`.
#   docker build -f docker/engine.Dockerfile -t epd-engine:0.1.0 .
# torch from PyPI ships its CUDA runtime; the same image runs on CPU (--device cpu).
# BASE: any image with python3 >= 3.11 and its venv module (default: the public Python image;
# CI passes a Debian base bootstrapped locally). Dependencies go into a virtual environment,
# so a distribution Python that refuses system-wide pip installs (PEP 668) works too.
ARG BASE=python:3.12-slim
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/epd PATH=/opt/epd/bin:$PATH
WORKDIR /app
RUN python3 -m venv /opt/epd

# Dependencies first, pinned by the lock file alone: this layer stays cached until the lock
# changes (README or code edits do not invalidate it).
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
