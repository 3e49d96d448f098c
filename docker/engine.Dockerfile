# Engine + router image: `epdctl serve` (role pools) and `epdctl router`.
#   docker build -f docker/engine.Dockerfile -t epd-engine:0.1.0 .
# torch from PyPI ships its CUDA runtime; the same image runs on CPU (--device cpu).
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# Dependencies first (cached layer), pinned by the lock file.
COPY pyproject.toml requirements.lock README.md ./
RUN pip install --no-deps -r requirements.lock

COPY engine/ engine/
COPY operator/ operator/
RUN pip install --no-deps . && epdctl --help >/dev/null

RUN useradd --uid 10001 --create-home epd && mkdir -p /models && chown epd /models
USER 10001
EXPOSE 8000 8080
ENTRYPOINT []
CMD ["epdctl", "--help"]
