# The two commands a new user needs: `make demo` and `make test` (each sets itself up first).
# `make test` needs root for apt (Chromium) and a Python <= 3.13 with a shared libpython (PYTHON=...).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-unit browser serving images podman images-local test-containers

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/ctrflow demo --out runs/demo
	@echo "Next: 'source $(BIN)/activate' puts ctrflow and mlflow on PATH for the README's steps."

# Debian's Chromium for the MLflow UI test (Playwright never downloads a browser here).
browser:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

# A second venv with a real tritonserver (nvidia-pytriton, python backend) for the serving tests.
serving: setup
	bash scripts/setup_triton.sh .venv-triton

# Tests run in parallel workers (pytest-xdist), a whole test file to a worker (tests/conftest.py), in
# the order collected (the slow integration files first). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup browser serving
	$(PYTEST)

test-unit: setup
	$(PYTEST) tests/unit

# Container images (docker/README.md): both built with docker or podman, whichever runs here, on the
# Dockerfiles' CUDA bases. IMAGE_REPO and IMAGE_TAG name them (default localhost/ctrflow/...:0.1.0).
images:
	bash scripts/build_images.sh

# podman + runc and a Debian base image, for a Debian machine without Docker (needs root).
LOCAL_BASE ?= localhost/ctrflow-base:bookworm
podman:
	bash scripts/setup_podman.sh $(LOCAL_BASE)

# Both images on that Debian base, with this machine's pip settings: CPU torch, and the serving
# image's tritonserver from nvidia-pytriton (python backend).
images-local: podman
	HOST_PIP=1 TRAIN_BASE=$(LOCAL_BASE) SERVE_BASE=$(LOCAL_BASE) \
	    SERVE_ARGS="WITH_TORCH=1 TRITON_WHEEL=nvidia-pytriton==0.7.0" bash scripts/build_images.sh

# The pipeline in its containers, a two-node TrainJob, the serving image: the tests marked `containers`,
# which `make test` leaves out (they skip without an engine).
test-containers: setup images-local
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,kubeflow]"
	$(BIN)/python -m pytest -q -m containers tests/integration
