"""A microVM suspended on one qemu node is restored on ANOTHER qemu node (issue 15, ADR 0081), for real:
one control plane, two qemu nodes (each its own data directory, root helper, agent and microVM template
checkpoint, made by its own cold boot under TCG here; tests/support/realcluster), the local-directory
object store. Through the SDK: a file on the guest's disk, a value in its /dev/shm and a Python process's
in-memory secret and counter survive the move; the source node keeps nothing of the sandbox."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from space.sdk import Sandbox
from tests.support import cluster as c
from tests.support import realcluster
from tests.support.realcluster import TwoNodeCluster

pytestmark = pytest.mark.root

LIMITS = {"cpus": 0.5, "memory_mb": 256}
SECRET_PROCESS = (
    "import os, time\n"
    "secret = os.urandom(8).hex()\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    with open('/dev/shm/beat.tmp', 'w') as f: f.write(f'{secret} {i}')\n"
    "    os.replace('/dev/shm/beat.tmp', '/dev/shm/beat')\n"
    "    time.sleep(0.1)\n"
)


@pytest.fixture(scope="module")
def two_qemu() -> Iterator[TwoNodeCluster]:
    started = time.monotonic()
    with realcluster.start_two_nodes(drivers=("qemu", "qemu")) as made:
        print(f"\ntwo qemu nodes up in {time.monotonic() - started:.1f}s")
        yield made


def beat(sb: Sandbox) -> tuple[str, int]:
    secret, count = sb.files.read("/dev/shm/beat").decode().split()
    return secret, int(count)


def test_a_microvm_moves_to_another_qemu_node_through_object_storage(two_qemu: TwoNodeCluster) -> None:
    sb = two_qemu.sdk.sandboxes.create(limits=LIMITS, isolation="microvm")
    try:
        source = two_qemu.node(sb.data["node_id"])
        sb.files.write("/root/kept.txt", b"on the guest's disk\n")
        sb.exec("echo in-guest-memory > /dev/shm/value")
        sb.processes.start(["python3", "-c", SECRET_PROCESS], tag="secret")
        c.wait_for(lambda: sb.exec("test -s /dev/shm/beat").exit_code == 0, timeout=60, what="a beat")
        secret, before = beat(sb)

        started = time.monotonic()
        assert sb.suspend().state == "suspended"
        suspend_s = time.monotonic() - started
        c.wait_for(lambda: two_qemu.holding(sb.id) == {}, timeout=60, interval=0.2, what="the copy gone")
        with two_qemu.drained(source):  # only the other qemu node may take the restore
            started = time.monotonic()
            assert sb.restore().state == "running"
            restore_s = time.monotonic() - started
        target = two_qemu.node(sb.refresh().data["node_id"])
        assert target is two_qemu.other(source)
        print(f"microVM moved between qemu nodes: suspend {suspend_s:.2f}s, restore {restore_s:.2f}s")
        assert sb.files.read("/root/kept.txt") == b"on the guest's disk\n"
        assert sb.exec("cat /dev/shm/value").stdout == "in-guest-memory\n"
        again, after = beat(sb)
        assert again == secret and after >= before, (secret, before, again, after)
        c.wait_for(lambda: beat(sb)[1] > after, timeout=30, what="the process counting on")
        assert two_qemu.holding(sb.id) == {target.name: "running"}
        assert [name for name in source.staging() if sb.id in name] == []
    finally:
        sb.delete(wait=True)
    assert two_qemu.holding(sb.id) == {}
