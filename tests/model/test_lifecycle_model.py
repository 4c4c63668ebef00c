"""The lifecycle model on a real control plane over fake-driver node agents (issue 11).

A hypothesis state machine (tests/support/lifecycle_model.py) sends random sequences of create, fork,
pause, resume, stop, start, suspend, restore, checkpoint, rollback, delete and exec requests, each once, as
concurrent twins, replayed with its Idempotency-Key or with the key reused for another request, and crashes
running sandboxes so that the reconciler recovers them; every answer is compared with what
space.core.lifecycle's table predicts, and after every step the invariants hold (a state of the table,
converged, generations monotonic, deleted stays deleted, exactly one copy on the two nodes).

The installation is real processes: `python -m space.controlplane.server` (API + reconciler, SQLite) and two
`python -m space.node.agent.server --driver fake` agents sharing a local-directory object store
(tests/support/cluster.py). `make test` runs a short profile; `make soak` (SPACE_SOAK=1) a long one.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
from collections.abc import Iterator

import pytest
from hypothesis.stateful import run_state_machine_as_test

from tests.support import cluster as c
from tests.support.lifecycle_model import LifecycleMachine, Tally, Target, machine_settings, soak

#: The long profile runs for most of an hour; the short one within pytest's default timeout.
pytestmark = pytest.mark.timeout(3600 if soak() else 300)

#: Hypothesis tries the simplest sequence first; the others are random.
SHORT = {"max_examples": 2, "stateful_step_count": 8}
LONG = {"max_examples": 30, "stateful_step_count": 25}


def guest_pids(node: c.FakeNode, sandbox_id: str) -> list[int]:
    """The fake driver's guest daemon of `sandbox_id`: host processes whose cwd is in its directory."""
    base = str(node.data_dir / "sandboxes" / sandbox_id)
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (
                os.readlink(proc / "cwd").startswith(base)
                and b"space.guest" in (proc / "cmdline").read_bytes()
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


class FakeTarget(Target):
    def __init__(self, cluster: c.Cluster) -> None:
        self.cluster = cluster
        self.url = cluster.url
        self.limits = dict(c.SMALL)
        self.holdings = self._holdings

    def _nodes(self) -> dict[str, c.FakeNode]:
        urls = {record.url: record.id for record in self.cluster.store.list_nodes(None)}
        return {urls[node.url]: node for node in self.cluster.nodes}

    def _holdings(self) -> dict[str, dict[str, str]]:
        return {
            node_id: {sid: str(item["state"]) for sid, item in node.sandboxes().items()}
            for node_id, node in self._nodes().items()
        }

    @functools.cached_property
    def project(self) -> c.Project:
        """The project the sequences run in (one for the whole test; each sequence deletes what it made)."""
        return c.new_project(self.cluster)

    def project_key(self) -> str:
        return self.project.key

    def crash(self, sandbox_id: str, node_id: str) -> None:
        pids = guest_pids(self._nodes()[node_id], sandbox_id)
        assert pids, f"no guest process of {sandbox_id} on {node_id}"
        c.kill_pids(pids)

    def tombstone(self, sandbox_id: str) -> str | None:
        record = self.cluster.store.load_sandbox(sandbox_id)
        return None if record is None else record.state.value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[c.Cluster]:
    with c.start_fake_cluster(tmp_path_factory.mktemp("model"), nodes=2, object_store=True) as made:
        yield made


def test_random_lifecycle_sequences_follow_the_table(cluster: c.Cluster) -> None:
    tally = Tally()

    target = FakeTarget(cluster)

    class FakeLifecycle(LifecycleMachine):
        TARGET = target
        TALLY = tally

    profile = LONG if soak() else SHORT
    run_state_machine_as_test(
        FakeLifecycle,
        settings=machine_settings(profile),
    )
    print(tally.line("lifecycle model, fake driver"), file=sys.stderr)
    assert tally.sequences >= 1 and tally.steps >= 1, tally.line("ran nothing")
    assert cluster.wait_converged(60, target.project.id) >= 0  # nothing left in flight or on a node
