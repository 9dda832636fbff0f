# The two commands a new user needs: `make demo` and `make test` (each sets itself up first).
# `make test` needs root for apt (Chromium) and a Python <= 3.13 with a shared libpython (PYTHON=...).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-unit browser serving

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

test: setup browser serving
	$(BIN)/python -m pytest -q

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit
