# Operator image: kopf + the EPD operator (no torch).
#   docker build -f docker/operator.Dockerfile -t epd-operator:0.1.0 .
# BASE: any image with python3 >= 3.11 and its venv module (default: the public Python image;
# CI passes a Debian base bootstrapped locally). Dependencies go into a virtual environment,
# so a distribution Python that refuses system-wide pip installs (PEP 668) works too.
ARG BASE=python:3.12-slim
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/epd PATH=/opt/epd/bin:$PATH
WORKDIR /app
RUN python3 -m venv /opt/epd

COPY pyproject.toml requirements.lock README.md ./
# The whole epd_engine source: the operator imports its torch-free modules (config, plan,
# transfer, profiler, ...). Only the core and `operator` extras are installed, so no torch.
# tests/images/test_dockerfiles.py imports the entry module from exactly these COPY lines.
COPY engine/ engine/
COPY operator/ operator/
RUN pip install -c requirements.lock ".[operator]" \
    && python -c "import epd_operator.kube.handlers"

RUN useradd --uid 10001 epd
USER 10001
EXPOSE 8080
CMD ["kopf", "run", "-m", "epd_operator.kube.handlers", "--standalone", "--all-namespaces", \
     "--liveness=http://0.0.0.0:8080/healthz"]
