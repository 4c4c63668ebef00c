"""Isolation per sandbox for real (issue 15, docs/adr/0076-isolation-per-sandbox.md): ONE control plane, a
runsc node and a qemu node (each its own data directory, root helper and agent; tests/support/realcluster).
Through the SDK, a default sandbox lands on the runsc node and answers gVisor's kernel release; a
`microvm` one lands on the qemu node and answers Debian's own kernel (under TCG on this machine); its fork
stays a microVM on the qemu node; what a microVM cannot do is a typed 409 naming it, from the API and from
the node alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from space.controlplane.store.records import SandboxRecord
from space.core import isolation
from space.core.lifecycle import State
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
    drivers = {n.id: (n.runtime or {}).get("driver") for n in mixed.db.list_nodes("ready")}
    assert drivers == {mixed.node_id(runsc_node): "runsc", mixed.node_id(qemu_node): "qemu"}
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
        _refused(vm.suspend, "suspend")
        assert mixed.sdk.sandboxes.get(vm.id).state == "running"

        # A suspend the API does not guard (a drain's, a deadline's `on_timeout: pause`) reaches the node:
        # its typed refusal crosses the node RPC, is permanent for the reconciler (no retries), and leaves
        # the microVM paused (the suspend's fail edge), from where it resumes with its memory.
        vm.exec("echo from-the-parent > /root/note")
        mixed.db.set_desired(vm.id, State.SUSPENDED)

        def refused() -> SandboxRecord | None:
            record = mixed.record(vm.id)
            return record if record.error_code == "not_supported" and record.state == State.PAUSED else None

        record = c.wait_for(refused, timeout=120, interval=0.2, what="the node's refusal recorded")
        assert record is not None and record.error_permanent and "microvm" in (record.error or "")
        vm.resume()
        assert vm.exec("cat /root/note").stdout == "from-the-parent\n"

        # A fork keeps the isolation: one checkpoint, restored as a second microVM on the qemu node.
        child = vm.fork()
        made.append(child)
        assert (child.isolation, child.data["node_id"]) == ("microvm", mixed.node_id(qemu_node))
        assert child.exec("cat /root/note; uname -r").stdout.split() == ["from-the-parent", release]
    finally:
        for sb in made:
            sb.delete(wait=True)
    assert all(mixed.holding(sb.id) == {} for sb in made)  # nothing left on either node
