# Operator image: kopf + the EPD operator (no torch).
#   docker build -f docker/operator.Dockerfile -t epd-operator:0.1.0 .
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY pyproject.toml requirements.lock README.md ./
COPY engine/epd_engine/__init__.py engine/epd_engine/config.py engine/epd_engine/plan.py engine/epd_engine/
COPY operator/ operator/
# Only the core and `operator` extras, pinned by the lock file (as constraints).
RUN pip install -c requirements.lock ".[operator]" \
    && python -c "import epd_operator.handlers"

RUN useradd --uid 10001 epd
USER 10001
EXPOSE 8080
CMD ["kopf", "run", "-m", "epd_operator.handlers", "--standalone", "--all-namespaces", \
     "--liveness=http://0.0.0.0:8080/healthz"]
