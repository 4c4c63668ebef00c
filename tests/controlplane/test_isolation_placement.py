"""Placement by isolation (issue 15, docs/adr/0076-isolation-per-sandbox.md): a sandbox goes only to nodes
whose reported driver provides its isolation (runsc and fake: gvisor; qemu: microvm), for a create, a
restore and a recovery alike; a create that no ready node can run is refused at once."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from space.controlplane.scheduler import check_admissible, choose_node
from space.controlplane.store import Store, open_store, sqlite_url
from space.controlplane.store.records import SandboxRecord
from space.core import errors, isolation, runtimes
from space.core.isolation import Isolation
from space.core.lifecycle import Event, State
from space.core.settings import SandboxLimits

RUNSC = runtimes.describe("runsc", platform="systrap", network="sandbox", runtime_version="0.0~20240729.0")
QEMU = runtimes.describe("qemu")
FAKE = runtimes.describe("fake")
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


def _sandbox(store: Store, kind: Isolation) -> SandboxRecord:
    """A new sandbox of `kind` in the store's one project (made with the first)."""
    org = store.get_org_by_name("o") or store.create_org("o")
    projects = store.list_projects(org.id)
    project = projects[0].id if projects else store.create_project(org.id, "p").id
    return store.create_sandbox(project, "python", {}, SandboxLimits(), isolation=kind)


def test_drivers_map_to_isolations_and_unknown_ones_offer_none() -> None:
    assert [isolation.of_node(d) for d in (RUNSC, FAKE, QEMU)] == ["gvisor", "gvisor", "microvm"]
    assert isolation.of_node(None) == "gvisor"  # an agent that never reported: it ran gVisor only
    for forged in ({"driver": "kvm"}, {"driver": "qemu\n"}, {"driver": ""}, "qemu", {"platform": "x"}):
        assert isolation.of_node(forged) is None


def test_each_isolation_lands_only_on_nodes_of_its_driver(store: Store) -> None:
    # The qemu node has the most room: a gVisor sandbox would go there if isolation were ignored.
    gvisor_node = _node(store, "a", RUNSC, memory_used=12000)
    microvm_node = _node(store, "b", QEMU)
    for _ in range(3):
        assert choose_node(store, _sandbox(store, "gvisor")) == gvisor_node
        assert choose_node(store, _sandbox(store, "microvm")) == microvm_node


def test_the_fake_driver_and_silent_nodes_count_as_gvisor(store: Store) -> None:
    fake = _node(store, "a", FAKE, memory_used=100)
    silent = _node(store, "b", None, memory_used=200)
    assert choose_node(store, _sandbox(store, "gvisor")) == fake
    store.set_node_status(fake, "lost")
    assert choose_node(store, _sandbox(store, "gvisor")) == silent


def test_no_node_of_the_isolation_is_a_typed_wait_and_a_refused_create(store: Store) -> None:
    _node(store, "a", RUNSC)
    _node(store, "b", {"driver": "kvm"})  # reports a driver of no isolation: never a candidate
    vm = _sandbox(store, "microvm")
    with pytest.raises(errors.ResourceExhausted) as waiting:
        choose_node(store, vm)
    assert waiting.value.details == {"reason": "no_node_for_isolation", "isolation": "microvm"}
    assert "no ready node runs microvm sandboxes" in waiting.value.message
    with pytest.raises(errors.Unavailable) as refused:
        check_admissible(store, SandboxLimits(), "microvm")
    assert refused.value.details["reason"] == "no_node_for_isolation"
    assert "no node runs microvm sandboxes" in refused.value.message and "gvisor" in refused.value.message
    check_admissible(store, SandboxLimits(), "gvisor")  # silent


def test_an_empty_cluster_lets_a_create_wait_for_its_node(store: Store) -> None:
    check_admissible(store, SandboxLimits(), "microvm")  # nothing is known yet: no refusal
    qemu = _node(store, "b", QEMU)
    check_admissible(store, SandboxLimits(), "microvm")
    with pytest.raises(errors.Unavailable):
        check_admissible(store, SandboxLimits(), "gvisor")  # the only ready node runs microVMs
    store.set_node_status(qemu, "lost")
    check_admissible(store, SandboxLimits(), "gvisor")


def test_disk_admission_counts_only_nodes_of_the_isolation(store: Store) -> None:
    big = store.register_node("http://big.test:1", "t" * 32, capacity={**CAPACITY, "disk_mb": 100_000})
    store.heartbeat(big.id, used={}, runtime=QEMU)
    small = store.register_node("http://small.test:1", "t" * 32, capacity={**CAPACITY, "disk_mb": 4096})
    store.heartbeat(small.id, used={}, runtime=RUNSC)
    check_admissible(store, SandboxLimits(disk_mb=50_000), "microvm")
    with pytest.raises(errors.StorageExhausted):
        check_admissible(store, SandboxLimits(disk_mb=50_000), "gvisor")


def _recovering(store: Store, kind: Isolation, node_id: str) -> SandboxRecord:
    """A sandbox that crashed on `node_id` and recovers from a full checkpoint taken there."""
    sb = _sandbox(store, kind)
    sb = store.transition(sb.id, State.PENDING, sb.generation, Event.CREATE, node_id=node_id)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CREATED)
    snap = store.create_snapshot(sb.id, "full", node_id)
    store.mark_snapshot_ready(snap.id, 1)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CRASH)
    return store.transition(
        sb.id, sb.state, sb.generation, Event.RECOVER, recovered_from=snap.id, node_id=None
    )


def test_a_recovery_keeps_its_isolation_and_its_checkpoints_driver(store: Store) -> None:
    first_vm_node = _node(store, "a", QEMU)
    gvisor_node = _node(store, "b", RUNSC)
    sb = _recovering(store, "microvm", first_vm_node)
    snap = store.get_snapshot(sb.recovered_from or "")
    assert snap is not None and snap.runtime == QEMU  # the checkpoint names the qemu driver (ADR 0035)
    store.set_node_status(first_vm_node, "lost")
    with pytest.raises(errors.ResourceExhausted) as caught:
        choose_node(store, sb)  # only a gVisor node is left: the microVM waits
    assert caught.value.details["reason"] == "no_node_for_isolation"
    second_vm_node = _node(store, "c", QEMU, memory_used=8000)
    assert choose_node(store, sb) == second_vm_node
    assert gvisor_node != second_vm_node


def test_a_checkpoint_names_its_driver_even_where_the_record_would_allow_a_node(store: Store) -> None:
    """Two guards, independent: a gVisor sandbox whose checkpoint a qemu node made (a row written before
    isolation existed, say) still goes only where the checkpoint's driver runs."""
    vm_node = _node(store, "a", QEMU)
    sb = _recovering(store, "gvisor", vm_node)
    _node(store, "b", RUNSC)
    with pytest.raises(errors.ResourceExhausted) as caught:
        choose_node(store, sb)
    assert caught.value.details["reason"] == "no_compatible_runtime"


def test_a_restore_after_suspend_goes_back_to_a_node_of_its_isolation(store: Store) -> None:
    """A suspended gVisor sandbox, restored while a roomier qemu node is ready: only gVisor nodes qualify,
    by its record and by its checkpoint's descriptor alike."""
    first = _node(store, "a", RUNSC)
    sb = _sandbox(store, "gvisor")
    sb = store.transition(sb.id, State.PENDING, sb.generation, Event.CREATE, node_id=first)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.CREATED)
    snap = store.create_snapshot(sb.id, "full", first)
    store.mark_snapshot_ready(snap.id, 1)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.SUSPEND, suspended_snapshot_id=snap.id)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.SUSPENDED, node_id=None)
    sb = store.transition(sb.id, sb.state, sb.generation, Event.RESTORE)
    assert sb.state == State.RESTORING
    store.set_node_status(first, "lost")
    _node(store, "b", QEMU)
    with pytest.raises(errors.ResourceExhausted) as caught:
        choose_node(store, sb)
    assert caught.value.details["reason"] == "no_node_for_isolation"
    second = _node(store, "c", RUNSC, memory_used=9000)
    assert choose_node(store, sb) == second


# A microVM suspended to object storage is restored only on a qemu node (ADR 0081 over ADR 0076's guard):
# its suspend row names the qemu driver its node reported, so neither a roomier gVisor node nor a gVisor
# sandbox record would take it, and the restore waits, typed, until a qemu node is ready.


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
