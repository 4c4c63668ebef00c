# Every target does its own set-up (idempotent), so each works on a fresh Debian 12 machine as root.
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup check test test-unit demo bench clean-host

setup:
	@bash scripts/setup.sh

check: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy
	$(PY) scripts/check_imports.py

test: check
	$(PY) -m pytest tests -q

test-unit: setup
	$(PY) -m pytest tests/unit -q

demo: setup
	$(PY) -m space.node.demo

bench: setup
	$(PY) -m bench.node_bench

# Removes every sandbox, mount and loop device SPACE test runs may have left (for a developer's machine).
clean-host: setup
	$(PY) -m space.node.cleanup --all-test-dirs
