# Every target does its own set-up (idempotent), so each works on a fresh Debian 12 machine as root.
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup check test test-unit demo demo-node bench clean-host soak fuzz

# setup also byte-compiles the editable install's own modules: PYTHONDONTWRITEBYTECODE (above) keeps every
# process from writing them, and without them each control plane, agent, helper and CLI process compiled
# ~300 modules at start (measured: a control-plane import took 8.2 s of CPU without them, 3.4 s with).
setup:
	@bash scripts/setup.sh
	@$(PY) -c "import matplotlib" 2>/dev/null || $(VENV)/bin/pip install -q -e ".[bench]"
	@$(PY) -m compileall -q src

check: setup
	$(VENV)/bin/ruff check src tests bench examples scripts
	$(VENV)/bin/ruff format --check src tests bench examples scripts
	$(VENV)/bin/mypy
	$(PY) scripts/check_imports.py
	$(PY) scripts/check_shape.py
	$(PY) scripts/check_docs.py
	$(PY) scripts/gen_sync_sdk.py --check

# Two pytest sessions side by side: the root tests and the rest (scripts/run_tests.py says why).
test: check
	$(PY) scripts/run_tests.py

# The fast tests: every test that needs no root (tests/conftest.py refuses a root-needing test without the mark).
test-unit: setup
	$(PY) -m pytest tests -q -m "not root"

DEMO_DIR := /var/lib/space-demo
DEMO_PORT := 8470

# The main job: `space up` on this machine, the lifecycle end to end with the SDK, then `space down`.
demo: setup
	$(PY) -m space.cli.main up --data-dir $(DEMO_DIR) --port $(DEMO_PORT) --detach
	$(PY) examples/lifecycle_demo.py; status=$$?; \
	  $(PY) -m space.cli.main down --data-dir $(DEMO_DIR) --purge; exit $$status

# The node-level demo (no control plane): one sandbox driven directly through the node agent.
demo-node: setup
	$(PY) -m space.node.demo

# The long modes of the reliability harness (issue 11): the same tests as in `make test`, run longer.
soak: setup
	SPACE_SOAK=1 $(PY) -m pytest -q tests/crash tests/model tests/load tests/e2e/test_multinode_chaos.py \
		tests/objectstore/test_storage_faults.py tests/objectstore/test_storage_faults_e2e.py \
		tests/controlplane/test_controlplane_suspend.py

fuzz: setup
	SPACE_FUZZ=long $(PY) -m pytest -q tests/fuzz

# `space bench` on an installation of its own (issue 12); the node-level benchmark is bench.node_bench.
bench: setup
	$(PY) -m space.cli.main bench --embedded

# Removes every sandbox, mount and loop device SPACE test runs may have left (for a developer's machine).
clean-host: setup
	$(PY) -m space.node.cleanup --all-test-dirs
