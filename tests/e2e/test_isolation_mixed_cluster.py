"""Isolation per sandbox for real (issue 15, docs/adr/0076-isolation-per-sandbox.md): ONE control plane, a
runsc node and a qemu node (each its own data directory, root helper and agent; tests/support/realcluster).
Through the SDK, a default sandbox lands on the runsc node and answers gVisor's kernel release; a
`microvm` one lands on the qemu node and answers Debian's own kernel (under TCG on this machine); its fork
stays a microVM on the qemu node; it suspends to object storage and is restored on the qemu node (ADR
0081); what a microVM cannot do is a typed 409 naming it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from space.core import isolation
from space.sdk import Sandbox
from space.sdk.errors import SpaceError
from tests.support import cluster as c
from tests.support import realcluster
from tests.support.realcluster import TwoNodeCluster

pytestmark = pytest.mark.root

LIMITS = {"cpus": 0.5, "memory_mb": 256}
GVISOR_RELEASE = "4.4.0"  # what gVisor's Sentry reports as its kernel release


@pytest.fixture(scope="module")
def mixed() -> Iterator[TwoNodeCluster]:
    started = time.monotonic()
    with realcluster.start_two_nodes(drivers=("runsc", "qemu")) as made:
        print(f"\nrunsc + qemu cluster up in {time.monotonic() - started:.1f}s")
        yield made


def _refused(call: Callable[[], object], operation: str) -> None:
    with pytest.raises(SpaceError) as caught:
        call()
    assert caught.value.code == "not_supported", caught.value
    assert caught.value.message == isolation.unsupported("microvm", operation)


def test_each_isolation_runs_on_its_own_node(mixed: TwoNodeCluster) -> None:
    runsc_node, qemu_node = mixed.nodes
    wanted = {mixed.node_id(runsc_node): "runsc", mixed.node_id(qemu_node): "qemu"}

    def drivers() -> dict[str, object]:
        return {n.id: (n.runtime or {}).get("driver") for n in mixed.db.list_nodes("ready")}

    # A node's runtime arrives with its first heartbeat after registering (the record may hold only the
    # node's release before that).
    c.wait_for(lambda: drivers() == wanted, timeout=60, interval=0.2, what=f"both drivers reported: {wanted}")
    made: list[Sandbox] = []
    try:
        plain = mixed.sdk.sandboxes.create(limits=LIMITS)
        made.append(plain)
        assert (plain.isolation, plain.data["node_id"]) == ("gvisor", mixed.node_id(runsc_node))
        assert plain.exec("uname -r").stdout.strip() == GVISOR_RELEASE

        started = time.monotonic()
        vm = mixed.sdk.sandboxes.create(limits=LIMITS, isolation="microvm")
        made.append(vm)
        print(f"\nmicroVM create through the API: {time.monotonic() - started:.2f}s")
        assert (vm.isolation, vm.data["node_id"]) == ("microvm", mixed.node_id(qemu_node))
        release = vm.exec("uname -r").stdout.strip()
        assert release.endswith("-amd64") and release != GVISOR_RELEASE, release  # Debian's own kernel
        assert mixed.sdk.sandboxes.get(vm.id).isolation == "microvm"

        # What a microVM cannot do is refused before the node is asked, naming the isolation.
        _refused(lambda: vm.snapshots.create(full=False), "disk_snapshot")
        assert mixed.sdk.sandboxes.get(vm.id).state == "running"

        # Suspend to object storage and restore through the API (ADR 0081): the artifact names the qemu
        # driver, so the restore goes back to the qemu node although the runsc node is ready and roomy; a
        # file and a value in the guest's memory (/dev/shm, tmpfs) come back.
        vm.exec("echo from-the-parent > /root/note; echo in-memory > /dev/shm/value")
        started = time.monotonic()
        assert vm.suspend().state == "suspended"
        suspend_s = time.monotonic() - started
        assert vm.refresh().data["node_id"] is None
        c.wait_for(lambda: mixed.holding(vm.id) == {}, timeout=60, interval=0.2, what="the node's copy gone")
        started = time.monotonic()
        assert vm.restore().state == "running"
        restore_s = time.monotonic() - started
        print(f"microVM suspend {suspend_s:.2f}s, restore {restore_s:.2f}s through the API")
        assert vm.refresh().data["node_id"] == mixed.node_id(qemu_node)
        assert vm.exec("cat /root/note /dev/shm/value").stdout == "from-the-parent\nin-memory\n"

        # A fork keeps the isolation: one checkpoint, restored as a second microVM on the qemu node.
        child = vm.fork()
        made.append(child)
        assert (child.isolation, child.data["node_id"]) == ("microvm", mixed.node_id(qemu_node))
        assert child.exec("cat /root/note; uname -r").stdout.split() == ["from-the-parent", release]
    finally:
        for sb in made:
            sb.delete(wait=True)
    assert all(mixed.holding(sb.id) == {} for sb in made)  # nothing left on either node
