# Bootstrap a .venv on Python >= 3.12 and run the two README commands.
#   make train   set up if needed, then train the tiny model on the embedded corpus
#   make test    set up if needed, then run the test suite's first tier (every module and
#                kernel; under 10 minutes on 2 cores)
#   make test-all  the whole suite: the first tier and the long end-to-end runs (`slow`),
#                among them the live comparison with transformers' Kimi Linear (reference-env)
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= workdir/tiny
CONFIG ?= configs/tiny.py
ARGS ?=
PYTEST_WORKERS ?= 2   # xdist processes; most of the time is single-threaded compiles

# First interpreter that actually runs as Python >= 3.12: python3.12 / python3.13 on PATH
# (pyenv shims on PATH may not resolve, so each candidate is executed), then pyenv's versions.
PYENV_ROOT := $(shell pyenv root 2>/dev/null || echo $$HOME/.pyenv)
CANDIDATES := $(shell command -v python3.12 python3.13 2>/dev/null) \
              $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12 $(PYENV_ROOT)/versions/3.13*/bin/python3.13)
FOUND_PY := $(firstword $(foreach p,$(CANDIDATES),$(shell $(p) -c 'import sys; assert sys.version_info >= (3, 12); print("$(p)")' 2>/dev/null)))

# The reference side of tests/test_kimi_hf.py's live test: Hugging Face transformers'
# kimi_linear on PyTorch's CPU build, in its own venv (moe_jax never imports torch). Python
# 3.11 first: these machines keep PyTorch's CPU wheel for it on disk (elsewhere pip takes
# torch from PyPI, a CUDA build of several GB).
REF_VENV := .venv-ref
REF_CANDIDATES := $(shell command -v python3.11 2>/dev/null) \
                  $(wildcard $(PYENV_ROOT)/versions/3.11*/bin/python3.11) $(CANDIDATES)
REF_PY := $(firstword $(foreach p,$(REF_CANDIDATES),$(shell $(p) -c 'import sys; assert sys.version_info >= (3, 10); print("$(p)")' 2>/dev/null)))

.PHONY: setup train test test-all reference-env clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	@if [ -z "$(FOUND_PY)" ]; then \
	  echo "error: no working Python >= 3.12. Looked for python3.12 / python3.13 on PATH and" \
	       "$(PYENV_ROOT)/versions/3.1[23]*/bin/python3.1[23]. Install Python 3.12+ and retry." >&2; exit 1; fi
	@echo "Using $(FOUND_PY)"
	test -x $(PY) || $(FOUND_PY) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# libtpu's compiler for the TPU ahead-of-time test, in its own folder: on PYTHONPATH only
	# in that test's subprocess, so no other process tries to start a TPU runtime.
	$(PY) -m pip install -q --no-deps --target $(VENV)/tpu_aot 'libtpu==0.0.48.*'
	touch $@

reference-env: $(REF_VENV)/.installed

$(REF_VENV)/.installed:
	test -x $(REF_VENV)/bin/python || $(REF_PY) -m venv $(REF_VENV)
	$(REF_VENV)/bin/pip install -q 'torch==2.13.0'
	$(REF_VENV)/bin/pip install -q 'transformers==5.23.0' 'safetensors==0.8.0' numpy
	touch $@

train: setup
	$(PY) scripts/train.py --config=$(CONFIG) --workdir=$(WORKDIR) $(ARGS)

PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15

test: setup
	$(PYTEST) -m "not slow" tests

test-all: setup reference-env
	$(PYTEST) tests

clean:
	rm -rf $(VENV) $(REF_VENV) workdir *.egg-info
