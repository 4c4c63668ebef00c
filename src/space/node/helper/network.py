"""Per-sandbox network slots: which slot each sandbox has, a pool of ready ones, and the node's network
state (root helper only). Names and addresses are in space.node.helper.netaddr, the commands that make and
remove namespaces and links in space.node.helper.netns, the rulesets in space.node.helper.nftables.

One sandbox's network is a *slot*: two network namespaces and two veth pairs, named after the node's tag
T (from its data directory, so two nodes on one machine never collide) and the slot number i:

    gVisor netstack ─ eth0 ┐ netns spTs<i>  10.99.0.2/30 via 10.99.0.1: the SAME in every sandbox, so a
                           │                checkpoint restores and forks into any slot on any node
                     in0 ──┘ netns spTe<i>  the edge: 10.99.0.1/30 inside, host_addr/32 outside; SNAT
                     up0 ──┐                10.99.0.2 -> host_addr, DNAT 10.99.0.1 -> gateway_addr, forwards
                           │                nothing else (no other source, no IPv6, no inbound)
                  spThi ───┘ root netns     route host_addr/32; table `inet space_T` lets traffic from the
                                            slots reach only the egress gateway's ports on gateway_addr
                                            (TCP 80/443 and UDP/TCP 53 anywhere are redirected to it);
                                            everything else from or to a slot is dropped

A microVM (docs/adr/0080-microvm-egress.md) uses the same slot: in spTs<i>, eth0 (without its address) and
a tap owned by the sandbox's uid are the two ports of a bridge; the guest's kernel holds 10.99.0.2 and the
MAC gVisor would take, so the edge and everything behind it see what they see of a gVisor sandbox.

Invariants:
- Every name and address is derived from the data directory and a slot number; callers name only
  validated sandbox ids.
- A sandbox's slot is recorded in `run/<sandbox>/network.json` (written atomically after the slot is
  complete); a slot nobody records, or whose sandbox has neither a bundle nor a microVM disk, is swept by
  `prepare()`; `release()` and `teardown()` remove namespaces, links and (teardown) the node's table and
  gateway link, so nothing outlives the node.
- host_addr is unique per live slot on the node and the gateway sees it as the source of every packet a
  sandbox sends (it cannot be spoofed: the edge forwards only 10.99.0.2, and the root table drops any
  packet whose source does not route back through the link it came from).
- Rulesets are applied with one `nft -f` each (atomic replace), never rule by rule.
- Slots are made ahead of need by a background thread (a small pool), so creating a sandbox does not wait
  for namespaces; a slot is used by one sandbox only and is deleted with it, never recycled.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import pathlib
import threading
from collections.abc import Iterable
from typing import Any

from space.core import errors
from space.node.helper import netns, nftables
from space.node.helper.netaddr import NETNS_DIR, SANDBOX_ADDR, SANDBOX_GATEWAY, SlotNames, node_tag
from space.node.helper.params import GatewayPorts
from space.node.layout import NodeLayout

POOL_SIZE = 2
#: Where a microVM sandbox's disk and metadata live (space.node.helper.microvm, which imports this module):
#: a microVM has no bundle, and its recorded slot must survive node.prepare's sweep like a runsc sandbox's.
MICROVM_SANDBOXES = pathlib.Path("microvm") / "sandboxes"


def _write_json_atomic(path: pathlib.Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def set_bundle_netns(config: dict[str, Any], netns: pathlib.Path | None) -> None:
    """Point the bundle's network namespace at the sandbox's (or, without one, let runsc make an empty
    one: a config copied from another node or mode must not name a namespace that is not ours)."""
    namespaces = config.setdefault("linux", {}).setdefault("namespaces", [])
    kept = [ns for ns in namespaces if ns.get("type") != "network"]
    kept.append({"type": "network", "path": str(netns)} if netns else {"type": "network"})
    config["linux"]["namespaces"] = kept


def prepare_launch(network: SandboxNetworks | None, sandbox_id: str, config: dict[str, Any]) -> list[str]:
    """Called for every boot or restore: sets the bundle's network namespace and returns the argv prefix
    runsc must be started with (empty when the node gives sandboxes no network)."""
    if network is None:
        set_bundle_netns(config, None)
        return []
    return network.attach(sandbox_id, config)


class SandboxNetworks:
    def __init__(self, layout: NodeLayout, *, pool_size: int = POOL_SIZE) -> None:
        self.layout = layout
        self.tag = node_tag(layout.data_dir)
        self.names = SlotNames(self.tag)
        self.table = self.names.table
        self.gateway_link = self.names.gateway_link
        self.pool_size = pool_size
        self._lock = threading.Lock()
        self._used: set[int] = set()
        self._unrecorded: set[int] = set()  # this process' slots no record names yet (pool, in the making)
        self._pool: list[int] = []
        self._fresh: set[int] = set()  # slots whose sandbox interface still has its address
        self._cursor = 0  # where the search for a free slot number starts
        self._refill: threading.Thread | None = None
        self._closing = False
        self._block: ipaddress.IPv4Network | None = None
        self._ports: GatewayPorts | None = None

    # -- names and addresses -----------------------------------------------------------------------------
    @property
    def state_path(self) -> pathlib.Path:
        return self.layout.data_dir / "network.json"

    def sandbox_ns(self, slot: int) -> str:
        return self.names.sandbox_ns(slot)

    def edge_ns(self, slot: int) -> str:
        return self.names.edge_ns(slot)

    def host_link(self, slot: int) -> str:
        return self.names.host_link(slot)

    def _record_path(self, sandbox_id: str) -> pathlib.Path:
        return self.layout.run_dir(sandbox_id) / "network.json"

    @property
    def block(self) -> ipaddress.IPv4Network:
        if self._block is None:
            saved = self._load_state().get("block")  # a restarted helper, before node.prepare ran again
            if not saved:
                raise errors.InvalidState("the node's network is not prepared", state="unprepared")
            self._block = ipaddress.IPv4Network(saved)
        return self._block

    @property
    def gateway_addr(self) -> ipaddress.IPv4Address:
        return self.block.network_address + 1

    def host_addr(self, slot: int) -> ipaddress.IPv4Address:
        return self.block.network_address + 2 + slot

    @property
    def max_slots(self) -> int:
        return self.block.num_addresses - 3  # minus network, gateway, broadcast

    # -- node ------------------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Gateway link, address block, root table; sweep slots no sandbox records; start the pool."""
        state = self._load_state()
        saved = ipaddress.IPv4Network(state["block"]) if state.get("block") else None
        block = saved or netns.claim_block(
            self.tag, lambda chosen: netns.ensure_gateway_link(self.names, chosen.network_address + 1)
        )
        with self._lock:
            self._closing = False
            self._block = block
            ports = state.get("ports")
            self._ports = GatewayPorts.model_validate(ports) if ports else None
        self._save_state()
        netns.ensure_gateway_link(self.names, self.gateway_addr)
        self._apply_root_ruleset()
        self._sweep()
        self._start_refill()
        return self.info()

    def info(self) -> dict[str, Any]:
        return {
            "mode": "sandbox",
            "gateway_addr": str(self.gateway_addr),
            "ports": self._ports.model_dump() if self._ports else None,
            "block": str(self.block),
            "table": f"inet {self.table}",
            "sandbox_addr": str(SANDBOX_ADDR),
            "sandbox_gateway_addr": str(SANDBOX_GATEWAY),
        }

    def configure(self, ports: GatewayPorts) -> dict[str, Any]:
        with self._lock:
            self._ports = ports
        self._save_state()
        self._apply_root_ruleset()
        return self.info()

    def settle(self) -> list[int]:
        """Wait for a pool refill in progress; the slots now pooled (tests and benchmarks)."""
        with self._lock:
            refill = self._refill
        if refill is not None:
            refill.join(60)
        with self._lock:
            return list(self._pool)

    def teardown(self) -> None:
        """Remove every slot of this node, its gateway link and its table (node.teardown)."""
        with self._lock:
            self._closing = True
            refill = self._refill
        if refill is not None:
            refill.join(60)
        slots = netns.existing_slots(self.names)
        with self._lock:
            slots |= self._used
            self._pool.clear()
            self._used.clear()
            self._unrecorded.clear()
            self._fresh.clear()
        self._delete_slots(slots)
        for record in self.layout.run.glob("*/network.json") if self.layout.run.exists() else []:
            record.unlink(missing_ok=True)
        netns.remove_gateway_link_and_table(self.names)

    # -- sandboxes -------------------------------------------------------------------------------------------
    def attach(self, sandbox_id: str, config: dict[str, Any]) -> list[str]:
        """Give the sandbox its slot (its own from before, else a fresh one) ready for runsc to scrape."""
        slot, _new = self._claim(sandbox_id, reset_interface=True)
        namespace = NETNS_DIR / self.sandbox_ns(slot)
        set_bundle_netns(config, namespace)
        return netns.runsc_entry(namespace, self.layout.data_dir)

    def attach_microvm(self, sandbox_id: str, uid: int) -> pathlib.Path:
        """Give a microVM its slot (its own from before, else a fresh one) with a tap owned by `uid` on the
        veth end gVisor would use (docs/adr/0080-microvm-egress.md); the namespace QEMU must start in."""
        slot, new = self._claim(sandbox_id, reset_interface=False)
        # Its own slot again (restart, rollback): the tap and bridge outlive QEMU and are kept.
        if new or not netns.microvm_tap_exists(self.names, slot):
            netns.wire_microvm_tap(self.names, slot, uid, fresh=new)
        return NETNS_DIR / self.sandbox_ns(slot)

    def _claim(self, sandbox_id: str, *, reset_interface: bool) -> tuple[int, bool]:
        """The sandbox's slot and whether it is new to it (else its own recorded one, still complete)."""
        record = self._read_record(sandbox_id)
        slot = record.get("slot") if record else None
        if isinstance(slot, int) and netns.slot_exists(self.names, slot):
            with self._lock:
                fresh = slot in self._fresh
                self._fresh.discard(slot)
            if not fresh and reset_interface:
                self._reset_sandbox_interface(slot)  # the last runsc moved its address into gVisor
        else:
            if isinstance(slot, int):
                self._delete_slots({slot})  # recorded but incomplete (e.g. lost at reboot)
            slot = self._take()
            with self._lock:
                self._fresh.discard(slot)  # this launch uses up its address
            try:
                self.layout.run_dir(sandbox_id).mkdir(parents=True, exist_ok=True)
                _write_json_atomic(self._record_path(sandbox_id), {"slot": slot})
            except OSError as exc:
                self._delete_slots({slot})
                raise errors.RuntimeFailure(f"cannot record the network of {sandbox_id}: {exc}") from exc
            with self._lock:
                self._unrecorded.discard(slot)
            return slot, True
        return slot, False

    def release(self, sandbox_id: str) -> None:
        record = self._read_record(sandbox_id)
        slot = record.get("slot") if record else None
        if isinstance(slot, int):
            self._delete_slots({slot})
        self._record_path(sandbox_id).unlink(missing_ok=True)

    def describe(self, sandbox_id: str) -> dict[str, Any]:
        record = self._read_record(sandbox_id)
        slot = record.get("slot") if record else None
        if not isinstance(slot, int):
            raise errors.NotFound(f"sandbox {sandbox_id} has no network on this node", sandbox_id=sandbox_id)
        return {
            "sandbox_id": sandbox_id,
            "host_addr": str(self.host_addr(slot)),
            "sandbox_addr": str(SANDBOX_ADDR),
            "gateway_addr": str(self.gateway_addr),
            "sandbox_gateway_addr": str(SANDBOX_GATEWAY),
            "ports": self._ports.model_dump() if self._ports else None,
            "netns": self.sandbox_ns(slot),
        }

    # -- state -----------------------------------------------------------------------------------------------
    def _load_state(self) -> dict[str, Any]:
        try:
            value = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return value if isinstance(value, dict) else {}

    def _save_state(self) -> None:
        _write_json_atomic(
            self.state_path,
            {"block": str(self.block), "ports": self._ports.model_dump() if self._ports else None},
        )

    def root_ruleset(self) -> str:
        return nftables.root_ruleset(self.names, self.gateway_addr, self._ports)

    def edge_ruleset(self, host_addr: ipaddress.IPv4Address) -> str:
        return nftables.edge_ruleset(self.gateway_addr, host_addr)

    def _apply_root_ruleset(self) -> None:
        netns.run(["nft", "-f", "-"], stdin=self.root_ruleset(), what="nft (node table)")

    # -- slots -----------------------------------------------------------------------------------------------
    def _recorded_slots(self) -> set[int]:
        recorded: set[int] = set()
        for path in self.layout.run.glob("*/network.json") if self.layout.run.exists() else []:
            sandbox_id = path.parent.name
            slot = (self._read_record(sandbox_id) or {}).get("slot")
            if not isinstance(slot, int):
                continue
            if (
                self.layout.bundle(sandbox_id).exists()
                or (self.layout.fs / MICROVM_SANDBOXES / sandbox_id / "meta.json").is_file()
            ):
                recorded.add(slot)
            else:
                path.unlink(missing_ok=True)  # the sandbox is gone: so is its claim
        return recorded

    def _sweep(self) -> None:
        recorded = self._recorded_slots()
        stale = netns.existing_slots(self.names) - recorded
        with self._lock:
            stale -= self._unrecorded
            self._used |= recorded
        self._delete_slots(stale)

    def _read_record(self, sandbox_id: str) -> dict[str, Any] | None:
        try:
            value = json.loads(self._record_path(sandbox_id).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def _allocate(self) -> int:
        with self._lock:
            if self._closing:
                raise errors.Unavailable("the node's network is being torn down")
            existing = netns.existing_slots(self.names) | self._used
            # Round robin, not lowest-free: a host address (which the gateway and conntrack know a sandbox
            # by) comes back to another sandbox as late as possible.
            for offset in range(self.max_slots):
                slot = (self._cursor + offset) % self.max_slots
                if slot not in existing:
                    self._used.add(slot)
                    self._unrecorded.add(slot)
                    self._cursor = slot + 1
                    return slot
        raise errors.ResourceExhausted("no free network slot on this node")

    def _take(self) -> int:
        with self._lock:
            slot = self._pool.pop(0) if self._pool else None
        if slot is None:
            slot = self._allocate()
            try:
                self._create_slot(slot)
            except errors.SpaceError:
                self._delete_slots({slot})
                raise
        self._start_refill()
        return slot

    def _start_refill(self) -> None:
        with self._lock:
            if self._closing or (self._refill is not None and self._refill.is_alive()):
                return
            self._refill = threading.Thread(target=self._refill_pool, name="network-pool", daemon=True)
            self._refill.start()

    def _refill_pool(self) -> None:
        while True:
            with self._lock:
                if self._closing or len(self._pool) >= self.pool_size:
                    return
            try:
                slot = self._allocate()
            except errors.SpaceError:
                return
            try:
                self._create_slot(slot)
            except errors.SpaceError:
                self._delete_slots({slot})
                return
            with self._lock:
                if self._closing:
                    closing = True
                else:
                    closing = False
                    self._pool.append(slot)
            if closing:
                self._delete_slots({slot})
                return

    def _create_slot(self, slot: int) -> None:
        netns.create_slot(self.names, slot, self.host_addr(slot), self.gateway_addr)
        with self._lock:
            self._fresh.add(slot)

    def _reset_sandbox_interface(self, slot: int) -> None:
        netns.reset_sandbox_interface(self.names, slot)

    def _delete_slots(self, slots: Iterable[int]) -> None:
        slots = sorted(set(slots))
        if not slots:
            return
        left = netns.delete_slots(self.names, slots)
        with self._lock:
            for slot in slots:
                if slot not in left:
                    self._used.discard(slot)
                    self._unrecorded.discard(slot)
                self._fresh.discard(slot)
                with contextlib.suppress(ValueError):
                    self._pool.remove(slot)
        if left:
            raise errors.RuntimeFailure(f"network slots {left} could not be removed")
