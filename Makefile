# EPD Operator — `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
EPDCTL := $(VENV)/bin/epdctl
MODEL_DIR ?= models/tiny-llava
PORT ?= 8000
PYTEST_ARGS ?=

help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_.-]+:.*## / {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml requirements.lock
	@command -v uv >/dev/null || python3 -m pip install --quiet uv
	@test -x $(PY) || uv venv --quiet --python python3 $(VENV)
	uv pip install --quiet -p $(PY) -r requirements.lock
	uv pip install --quiet -p $(PY) --no-deps -e .
	@touch $@

venv: $(VENV)/.installed ## Create .venv with the pinned dependencies (uv)

lock: ## Re-resolve requirements.lock from pyproject.toml
	uv pip compile pyproject.toml --extra engine --extra operator --extra dev -o requirements.lock

$(MODEL_DIR)/config.json: | $(VENV)/.installed
	$(EPDCTL) make-model --preset tiny-llava $(MODEL_DIR)

model: $(MODEL_DIR)/config.json ## Make the tiny random-weight LLaVA checkpoint in models/

serve: venv model ## Run the system: router + default E+P+D pools on the tiny model (localhost:$(PORT))
	$(EPDCTL) up -f examples/tiny-e-p-d.yaml --port $(PORT)

serve-single: venv model ## Run one EPD engine instance on the tiny model (no router)
	$(EPDCTL) serve --model $(MODEL_DIR) --role EPD --port $(PORT)

test: venv ## Run the test suite (k8s tests start the local control plane when its binaries are built)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv ## ruff lint + format check, mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: venv ## Format and autofix with ruff
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

crds: venv ## Regenerate crds/ from operator/epd_operator/spec.py
	$(PY) -m epd_operator.crdgen crds/

cluster-bins: ## Build etcd, kube-apiserver, controller-manager, scheduler, kwok, helm into .build/ (cached)
	tools/cluster/build.sh

cluster-up: cluster-bins ## Start the local control plane on 127.0.0.1 (kubeconfig in .build/cluster/kubeconfig)
	tools/cluster/up.sh

cluster-down: ## Stop the local control plane
	tools/cluster/down.sh

bench-engine: venv model ## Engine throughput on the tiny model vs transformers (JSON)
	$(EPDCTL) bench-engine --model $(MODEL_DIR) --out benchmarks/results/engine-cpu.json

.PHONY: help venv lock model serve serve-single test lint fmt crds cluster-bins cluster-up cluster-down bench-engine
