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

# --compile-bytecode: every engine process a rollout starts imports torch & co. from .pyc;
# without it each start compiles them again where bytecode is not written
# (PYTHONDONTWRITEBYTECODE, read-only site-packages): 2-3x slower engine starts (bench-switch)
$(VENV)/.installed: pyproject.toml requirements.lock
	@command -v uv >/dev/null || python3 -m pip install --quiet uv
	@test -x $(PY) || uv venv --quiet --python python3 $(VENV)
	uv pip install --quiet --compile-bytecode -p $(PY) -r requirements.lock
	uv pip install --quiet -p $(PY) --no-deps -e .
	@touch $@

venv: $(VENV)/.installed ## Create .venv with the pinned dependencies (uv)

lock: ## Re-resolve requirements.lock from pyproject.toml
	uv pip compile pyproject.toml --extra engine --extra operator --extra dev -o requirements.lock

# The GPU image's locks, within requirements.lock's versions (the image installs all three):
# the engine with the `gpu` and `nixl` extras, and what its kernel build step installs alone
# (torch, FlashInfer and the CUDA compiler at torch's CUDA version; the compiler is removed
# there once the kernels are built), so only a change to those rebuilds the kernels.
lock-gpu: ## Re-resolve requirements-gpu.lock and requirements-gpu-build.lock (run after `make lock`)
	uv pip compile pyproject.toml --extra engine --extra gpu --extra nixl -c requirements.lock \
		--custom-compile-command "make lock-gpu" -o requirements-gpu.lock
	printf 'flashinfer-python\ncuda-toolkit[nvcc,cccl]\n' | uv pip compile - \
		-c requirements-gpu.lock --custom-compile-command "make lock-gpu" \
		-o requirements-gpu-build.lock

$(MODEL_DIR)/config.json: | $(VENV)/.installed
	$(EPDCTL) make-model --preset tiny-llava $(MODEL_DIR)

model: $(MODEL_DIR)/config.json ## Make the tiny random-weight LLaVA checkpoint in models/

serve: venv model ## Run the system: router + default E+P+D pools on the tiny model (localhost:$(PORT))
	$(EPDCTL) up -f examples/tiny-e-p-d.yaml --port $(PORT)

serve-single: venv model ## Run one EPD engine instance on the tiny model (no router)
	$(EPDCTL) serve --model $(MODEL_DIR) --role EPD --port $(PORT)

test: venv ## Run the test suite (k8s tests start the local control plane when its binaries are built)
	tools/test/suite.sh $(PY) $(PYTEST_ARGS)

lint: venv ## ruff lint + format check, mypy, the layout's import contracts (import-linter)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: venv ## Format and autofix with ruff
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

crds: venv ## Regenerate crds/ from operator/epd_operator/api/spec.py
	$(PY) -m epd_operator.api.crdgen crds/

cluster-bins: ## Build etcd, kube-apiserver, controller-manager, scheduler, kwok, helm into .build/ (cached)
	tools/cluster/build.sh

cluster-up: cluster-bins ## Start the local control plane on 127.0.0.1 with kwok GPU nodes and, as root, a real node (kubeconfig in .build/cluster/kubeconfig)
	tools/cluster/up.sh

cluster-down: ## Stop the local control plane and the real node, undoing its host changes
	tools/cluster/down.sh

bench-engine: venv model ## Engine throughput on the tiny model vs transformers (JSON)
	$(EPDCTL) bench-engine --model $(MODEL_DIR) --out benchmarks/results/engine-cpu.json
	$(PY) benchmarks/bench_served.py --model $(MODEL_DIR) --out benchmarks/results/served-cpu.json
	$(PY) -m epd_engine.bench.step_overhead --model $(MODEL_DIR) --out benchmarks/results/step-overhead-cpu.json
	$(PY) -m epd_engine.bench.step_share --model $(MODEL_DIR) --out benchmarks/results/step-share-cpu.json

.PHONY: help venv lock lock-gpu model serve serve-single test lint fmt crds cluster-bins cluster-up cluster-down bench-engine

# --- Kubernetes (operator, chart, end-to-end) ----------------------------------------------
KIND_CLUSTER ?= epd
IMAGE_TAG ?= dev
HELM ?= $(if $(wildcard .build/bin/helm),.build/bin/helm,helm)

k8s-test: venv cluster-bins ## End-to-end operator tests against the local control plane (must not skip)
	EPD_REQUIRE_K8S=1 $(PY) -m pytest tests/k8s $(PYTEST_ARGS)

helm-lint: cluster-bins ## helm lint --strict the operator chart
	.build/bin/helm lint --strict charts/epd-operator

BASE_IMAGE ?= python:3.12-slim
BUILDAH_STORAGE ?= overlay

images: ## Build the engine and operator images (docker if its daemon answers, else buildah on a local Debian base, as archives the real node imports)
	@if docker info >/dev/null 2>&1; then \
	  set -x; \
	  docker build --build-arg BASE=$(BASE_IMAGE) -f docker/engine.Dockerfile -t epd-engine:$(IMAGE_TAG) . && \
	  docker build --build-arg BASE=$(BASE_IMAGE) -f docker/operator.Dockerfile -t epd-operator:$(IMAGE_TAG) .; \
	else IMAGE_TAG=$(IMAGE_TAG) BUILDAH_STORAGE=$(BUILDAH_STORAGE) tools/images/build.sh operator engine; fi

# Not in `make images` (CI): FlashInfer's kernels compile for every GPU generation in the build,
# which CI's cold budget does not hold; docs/gpu.md "The GPU image" gives the figures.
images-gpu: ## Build the GPU engine image epd-engine-gpu (VARIANT=gpu: FlashInfer with its kernels built in, CuPy, NVML), then test it on CPU
	@if docker info >/dev/null 2>&1; then \
	  set -x; \
	  docker build --build-arg BASE=$(BASE_IMAGE) --build-arg VARIANT=gpu -f docker/engine.Dockerfile -t epd-engine-gpu:$(IMAGE_TAG) .; \
	else IMAGE_TAG=$(IMAGE_TAG) BUILDAH_STORAGE=$(BUILDAH_STORAGE) tools/images/build.sh engine-gpu; fi
	EPD_REQUIRE_GPU_IMAGE=1 IMAGE_TAG=$(IMAGE_TAG) $(PY) -m pytest tests/images/test_gpu_image.py $(PYTEST_ARGS)

kind-up: images ## Docker users: kind cluster + images + helm install + the tiny CPU example
	kind get clusters | grep -qx $(KIND_CLUSTER) || kind create cluster --name $(KIND_CLUSTER)
	kind load docker-image --name $(KIND_CLUSTER) epd-engine:$(IMAGE_TAG) epd-operator:$(IMAGE_TAG)
	$(HELM) upgrade --install epd-operator charts/epd-operator -n epd-system --create-namespace \
		--set image.tag=$(IMAGE_TAG) --set image.pullPolicy=Never --wait
	kubectl apply -f examples/k8s/epd-tiny-cpu.yaml
	kubectl wait --for=condition=Ready epd/tiny --timeout=15m
	@echo "Router: kubectl port-forward svc/tiny-router 8080:8080, then http://127.0.0.1:8080/v1"

kind-down: ## Delete the kind cluster
	kind delete cluster --name $(KIND_CLUSTER)

.PHONY: k8s-test helm-lint images images-gpu kind-up kind-down

# --- Trace-replay profiler (cost model, simulator, plan search) -----------------------------
bench-plan: venv ## Plan-search speed: reference scenarios + mixed traces, before/after, scaling, fleet (JSON)
	$(PY) benchmarks/bench_plan.py --out benchmarks/results/plan-search.json
	$(PY) benchmarks/bench_plan.py --mixed --fleet 256x10000 --out benchmarks/results/plan-search-mixed.json

bench-fidelity: venv model ## Simulator vs real system: 4 workload shapes x 3 methods x 3 rates, one calibration (JSON)
	$(PY) benchmarks/bench_fidelity_matrix.py --model-dir $(MODEL_DIR) \
		--out benchmarks/results/fidelity-matrix-cpu.json

bench-fidelity-quick: venv model ## The same matrix in a few minutes (20 requests, rates 1-2): before a simulator or scheduling change
	$(PY) benchmarks/bench_fidelity_matrix.py --quick --model-dir $(MODEL_DIR) \
		--out benchmarks/results/fidelity-matrix-quick-cpu.json

bench-fidelity-textcaps: venv model ## One shape (TextCaps), rates 1-4, as bench-fidelity ran before the matrix (JSON)
	$(PY) benchmarks/bench_fidelity.py --model-dir $(MODEL_DIR) --rates 1,2,3,4 --slo-ttft 0.75 --slo-tpot 0.1 \
		--out benchmarks/results/fidelity-cpu.json

.PHONY: bench-plan bench-fidelity bench-fidelity-quick bench-fidelity-textcaps

bench-disagg: venv model ## Per method: migration p50/p90, its share of e2e, router hop (tiny model, JSON)
	$(EPDCTL) bench-disagg --model $(MODEL_DIR) --out benchmarks/results/disagg-cpu.json

.PHONY: bench-disagg

bench-prefix: venv model ## Prefix cache on vs off, multi-turn sessions and a Mooncake trace, EPD and E+P+D: TTFT, prefill tokens, KV pages pulled (ratios, JSON)
	$(PY) -m benchmarks.bench_prefix --model $(MODEL_DIR) --out benchmarks/results/prefix-cpu.json
	$(PY) -m benchmarks.bench_prefix --model $(MODEL_DIR) --workload mooncake --out benchmarks/results/prefix-mooncake-cpu.json

.PHONY: bench-prefix

bench-emulate-start: venv ## An emulated instance's start (exec -> ready, CPU and wall s) and RSS, beside a bare interpreter (JSON)
	$(PY) -m benchmarks.bench_emulate_start --runs 5 --out benchmarks/results/emulate-start-cpu.json

.PHONY: bench-emulate-start

bench-engine-start: venv model ## A real engine's start (spawn -> ready, CPU and wall s), afresh vs forked from the zygote (JSON)
	$(PY) -m benchmarks.bench_engine_start --model $(MODEL_DIR) --runs 5 --out benchmarks/results/engine-start-cpu.json

.PHONY: bench-engine-start

bench-switch: venv model ## Switch under load through every method + a ratio: failures, TTFT around switches, decision->serving (JSON)
	$(PY) -m benchmarks.switch_drill --model $(MODEL_DIR) --out benchmarks/results/switch-cpu.json

.PHONY: bench-switch

ELASTIC_MINUTES ?= 10
bench-elastic: venv ## EMULATED H200 fleet (cost model, no engine speed) under the elastic loop: a day in ELASTIC_MINUTES (10); SLO share, failed, GPU-hours vs static, switches; + a 256-GPU day simulated (JSON, PNG)
	nice -n 5 $(PY) -m benchmarks.bench_elastic --minutes $(ELASTIC_MINUTES) --out benchmarks/results/elastic-emulated.json

.PHONY: bench-elastic

SOAK_S ?= 3600
bench-soak: venv model ## Soak: mixed traffic through reconciled local E+P+D, a switch every 5 min, SOAK_S seconds (3600): failed/hung, RSS and fds per process, pages, /dev/shm (JSON)
	nice -n 5 $(PY) -m benchmarks.soak --model $(MODEL_DIR) --duration-s $(SOAK_S) --out benchmarks/results/soak-cpu.json

.PHONY: bench-soak

bench-transfer: venv model ## Per backend: pull p50/p90, bandwidth, ratio to memcpy/raw socket/raw gloo (JSON)
	$(EPDCTL) bench-transfer --model $(MODEL_DIR) --out benchmarks/results/transfer-cpu.json

bench-transfer-gpu: venv ## GPU: cuda_ipc and nccl pulls of a 640-token LLaVA-1.5-7B KV cache and one image, vs a device copy (JSON)
	$(EPDCTL) bench-transfer --gpu --out benchmarks/results/transfer-gpu.json

.PHONY: bench-transfer bench-transfer-gpu

bench-gpu: venv ## GPU only: LLaVA-1.5-7B shapes, decode vs HBM floor, prefill, encode, dual stream (JSON)
	$(EPDCTL) bench-gpu --out benchmarks/results/gpu.json

.PHONY: bench-gpu

demo-loop: venv model ## The loop closes on its own: epdctl up (Auto), text-heavy then image-heavy traffic, re-plans by itself (PNG timeline + JSON)
	$(PY) -m benchmarks.demo_loop --model $(MODEL_DIR) --out benchmarks/results/demo-loop.json --png benchmarks/results/demo-loop.png $(if $(COST_MODEL),--cost-model $(COST_MODEL))

.PHONY: demo-loop
