# mfuwatch: the two entry points of the README.
#   make demo   a real training run with the agent attached (GPU if present, else CPU)
#   make test   the test suite (CPU only; Triton kernels run under TRITON_INTERPRET=1)
# Each target creates .venv and installs the project into it when needed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.mfuwatch-installed
DEMO_ARGS ?=
TEST_ARGS ?=

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	@# With no NVIDIA GPU, take the CPU build of torch first: a bare `torch>=2.4`
	@# would otherwise pull a multi-GB CUDA build.
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "NVIDIA GPU found: installing torch from the index"; $(PIP) install -q "torch>=2.4"; \
	  else \
	    echo "no NVIDIA GPU: installing the CPU build torch==2.13.0"; $(PIP) install -q torch==2.13.0; \
	  fi; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mfuwatch demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(TEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
