"""A microVM's network slot (docs/adr/0080-microvm-egress.md), with real namespaces, links and nftables: the
slot's veth end eth0 loses gVisor's address and joins a bridge with a tap owned by the sandbox's uid; doing
it again (restart, rollback) gives the same picture; node.prepare's sweep keeps the slot of a microVM that
exists (it has no bundle) and removes one whose microVM is gone; teardown leaves nothing."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.helper.netaddr import MICROVM_BRIDGE, MICROVM_TAP, MICROVM_TAP_MAC, MICROVM_UPLINK_MAC
from space.node.helper.network import MICROVM_SANDBOXES, SandboxNetworks
from space.node.layout import NodeLayout
from tests.support.host import network_traces

pytestmark = pytest.mark.root

UID = 0x6000_1234


@pytest.fixture
def networks() -> Iterator[SandboxNetworks]:
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-mvslot-", dir="/var/tmp")).resolve()
    networks = SandboxNetworks(NodeLayout(data_dir), pool_size=0)
    try:
        networks.prepare()
        yield networks
    finally:
        networks.teardown()
        tag = networks.tag
        shutil.rmtree(data_dir, ignore_errors=True)
        assert network_traces(tag) == []


def _links(namespace: str) -> dict[str, dict[str, object]]:
    shown = subprocess.run(["ip", "-n", namespace, "-j", "-d", "addr", "show"], capture_output=True,
                           text=True, check=True)  # fmt: skip
    return {entry["ifname"]: entry for entry in json.loads(shown.stdout)}


def _check_wire(namespace: str) -> None:
    links = _links(namespace)
    eth0, tap, bridge = links["eth0"], links[MICROVM_TAP], links[MICROVM_BRIDGE]
    assert eth0.get("master") == tap.get("master") == MICROVM_BRIDGE
    assert eth0["address"] == MICROVM_UPLINK_MAC and tap["address"] == MICROVM_TAP_MAC
    # no address in the namespace's own stack: the guest's kernel has 10.99.0.2, nothing here answers
    for link in (eth0, tap, bridge):
        assert link.get("addr_info") == [], link
    shown = subprocess.run(["ip", "-n", namespace, "tuntap", "show"], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    assert f"{MICROVM_TAP}: tap persist user {UID} group {UID}" in shown, shown


def test_microvm_slot_is_a_bridge_to_a_tap_of_the_sandbox_uid(networks: SandboxNetworks) -> None:
    sandbox_id = new_sandbox_id()
    namespace = networks.attach_microvm(sandbox_id, UID)
    assert namespace.name.startswith(f"sp{networks.tag}s")
    _check_wire(namespace.name)
    described = networks.describe(sandbox_id)
    assert described["netns"] == namespace.name
    # a restart or rollback: the same slot (host address), wired again
    assert networks.attach_microvm(sandbox_id, UID) == namespace
    _check_wire(namespace.name)
    assert networks.describe(sandbox_id)["host_addr"] == described["host_addr"]
    # another microVM (a fork child) gets a slot of its own
    other = new_sandbox_id()
    assert networks.attach_microvm(other, UID + 1) != namespace
    assert networks.describe(other)["host_addr"] != described["host_addr"]

    # node.prepare's sweep: a microVM that exists keeps its slot, one whose disk is gone loses it
    other_ns = pathlib.Path("/run/netns") / str(networks.describe(other)["netns"])
    box = networks.layout.fs / MICROVM_SANDBOXES / sandbox_id
    box.mkdir(parents=True)
    (box / "meta.json").write_text("{}")
    networks.prepare()
    assert networks.describe(sandbox_id)["netns"] == namespace.name
    assert namespace.exists()
    assert not other_ns.exists(), "the slot of a microVM that no longer exists survived the sweep"
    with pytest.raises(errors.NotFound):
        networks.describe(other)
    networks.release(sandbox_id)
    assert not namespace.exists()
