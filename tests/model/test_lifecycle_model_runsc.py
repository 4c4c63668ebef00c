"""The lifecycle model, shorter, on real runsc: the same state machine as
tests/model/test_lifecycle_model.py (tests/support/lifecycle_model.py) against `real_cluster`
(`space.controlplane.local.LocalCluster`: control plane with SQLite, root helper, node agent with runsc, a
local-directory object store). Every answer is compared with the transition table and the invariants are
checked after every step (the one node's own listing is the copy count). No crash injection here: the
fake-driver machine covers recovery; `make test` runs one short sequence, `make soak` several longer ones.
"""

from __future__ import annotations

import functools
import secrets
import sys

import httpx
import pytest
from hypothesis.stateful import run_state_machine_as_test

from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from space.node.agent.identity import default_rpc_token_file
from tests.support import cluster as c
from tests.support.lifecycle_model import LifecycleMachine, Tally, Target, machine_settings, soak

pytestmark = [pytest.mark.root, pytest.mark.timeout(3600 if soak() else 300)]

real_cluster = c.real_cluster

#: Hypothesis tries the simplest sequence first; the others are random.
SHORT = {"max_examples": 2, "stateful_step_count": 5}
LONG = {"max_examples": 8, "stateful_step_count": 20}


class RunscTarget(Target):
    def __init__(self, cluster: c.RealCluster) -> None:
        self.cluster = cluster
        self.url = cluster.url
        self.limits = {"cpus": 0.5, "memory_mb": 256}
        self.holdings = self._holdings
        self.store = Store(sqlite_url(cluster.data_dir))
        self.admin = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {cluster.api_key}"}, timeout=60.0
        )

    def close(self) -> None:
        self.admin.close()
        self.store.close()

    def _holdings(self) -> dict[str, dict[str, str]]:
        (node,) = self.store.list_nodes(None)
        token = default_rpc_token_file(self.cluster.data_dir).read_text().strip()
        answer = httpx.get(
            f"{node.url}/node/v1/sandboxes", params={"guest": "false"},
            headers={"Authorization": f"Bearer {token}"}, timeout=30.0,
        )  # fmt: skip
        answer.raise_for_status()
        return {node.id: {item["id"]: str(item["state"]) for item in answer.json()["sandboxes"]}}

    @functools.cache  # noqa: B019 - one project per target, for the whole test
    def project_key(self) -> str:
        name = f"model-{secrets.token_hex(4)}"
        made = self.admin.post("/v1/projects", json={"name": name})
        assert made.status_code == 201, made.text
        key = self.admin.post("/v1/keys", json={"project": name, "role": "member"})
        assert key.status_code == 201, key.text
        return str(key.json()["key"])

    def tombstone(self, sandbox_id: str) -> str | None:
        record = self.store.load_sandbox(sandbox_id)
        return None if record is None else record.state.value


def test_random_lifecycle_sequences_on_runsc(real_cluster: c.RealCluster) -> None:
    tally = Tally()
    target = RunscTarget(real_cluster)

    class RunscLifecycle(LifecycleMachine):
        TARGET = target
        TALLY = tally
        CRASHES = False
        MAX_LIVE = 1  # one sandbox (no fork here): the few steps go to its lifecycle

    try:
        run_state_machine_as_test(
            RunscLifecycle,
            settings=machine_settings(LONG if soak() else SHORT),
        )
    finally:
        target.close()
    print(tally.line("lifecycle model, runsc"), file=sys.stderr)
    assert tally.sequences >= 1 and tally.steps >= 1, tally.line("ran nothing")
