"""A microVM suspended to object storage is restored only on a qemu node (ADR 0081 over ADR 0076's guard):
its suspend row names the qemu driver its node reported, so neither a roomier gVisor node nor a gVisor
sandbox record would take it, and the restore waits, typed, until a qemu node is ready."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from space.controlplane.scheduler import choose_node
from space.controlplane.store import Store, open_store, sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.core import errors, isolation, runtimes
from space.core.isolation import Isolation
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits

RUNSC = runtimes.describe("runsc", platform="systrap", network="sandbox", runtime_version="0.0~20240729.0")
QEMU = runtimes.describe("qemu")
CAPACITY = {"cpus": 8.0, "memory_mb": 16384, "sandboxes": 100}


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[Store]:
    with open_store(sqlite_url(tmp_path)) as opened:
        yield opened


def _node(store: Store, name: str, runtime: object, memory_used: int = 0) -> str:
    node = store.register_node(f"http://{name}.test:1", "t" * 32, capacity=CAPACITY)
    store.heartbeat(
        node.id, used={"memory_mb": memory_used, "sandboxes": 0, "cpus": 0},
        runtime=runtimes.parse_or_none(runtime),
    )  # fmt: skip
    return node.id


def _suspended_and_restoring(store: Store, kind: Isolation, node: str) -> SandboxRecord:
    """A sandbox of `kind` that ran on `node`, suspended there (its row written as the reconciler does:
    a full checkpoint with a prefix, origin suspend), now asked to restore."""
    org = store.create_org("o")
    project = store.create_project(org.id, "p").id
    sb = store.create_sandbox(project, "python", {}, SandboxLimits(), isolation=kind)
    sb = store.transition(sb.id, State.PENDING, sb.generation, Event.CREATE, node_id=node)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CREATED)
    snap = store.create_snapshot(sb.id, "full", node, prefix=f"sandboxes/{sb.id}/s", origin="suspend")
    store.mark_snapshot_ready(snap.id, 1)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.SUSPEND, suspended_snapshot_id=snap.id)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.SUSPENDED, node_id=None)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.RESTORE)
    assert sb.state == State.RESTORING
    return sb


def test_suspend_is_no_longer_refused_for_microvms() -> None:
    for operation in ("suspend", "upload", "import"):
        assert isolation.unsupported("microvm", operation) is None
    assert isolation.unsupported("microvm", "disk_snapshot") is not None  # what still is refused


def test_a_suspended_microvm_restores_only_on_a_qemu_node(store: Store) -> None:
    first = _node(store, "a", QEMU)
    sb = _suspended_and_restoring(store, "microvm", first)
    snap = store.get_snapshot(sb.suspended_snapshot_id or "")
    assert snap is not None and snap.runtime == QEMU  # the suspend row names the qemu driver
    store.set_node_status(first, "lost")
    roomy_gvisor = _node(store, "b", RUNSC)
    with pytest.raises(errors.ResourceExhausted) as caught:
        choose_node(store, sb)
    assert caught.value.details["reason"] == "no_node_for_isolation"
    second = _node(store, "c", QEMU, memory_used=12000)
    assert choose_node(store, sb) == second != roomy_gvisor


def test_its_checkpoint_keeps_it_off_gvisor_nodes_whatever_the_record_says(store: Store) -> None:
    """A row claiming gvisor (forged or older) whose suspend checkpoint a qemu node made: the checkpoint's
    descriptor alone keeps its restore off every gVisor node."""
    first = _node(store, "a", QEMU)
    sb = _suspended_and_restoring(store, "gvisor", first)
    store.set_node_status(first, "lost")
    _node(store, "b", RUNSC)
    with pytest.raises(errors.ResourceExhausted) as caught:
        choose_node(store, sb)
    assert caught.value.details["reason"] == "no_compatible_runtime"
