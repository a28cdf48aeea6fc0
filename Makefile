# The one entry point. `make demo` and `make test` set up .venv themselves.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_MOONCAKE_CACHE ?= $(CURDIR)/.cache

.PHONY: setup demo test lint typecheck unit clean

setup:
	@scripts/bootstrap.sh

demo: setup
	$(PY) -m vllm_mooncake.demo

lint: setup
	$(PY) -m ruff check vllm_mooncake tests
	$(PY) -m ruff format --check vllm_mooncake tests

typecheck: setup
	$(PY) -m mypy

unit: setup
	$(PY) -m pytest -q

test: lint typecheck unit

clean:
	rm -rf .venv .cache .pytest_cache .mypy_cache
