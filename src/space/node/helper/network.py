"""Per-sandbox network namespaces, their NAT edge, and the node's nftables table (root helper only).

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

runsc scrapes the interfaces of the namespace named in the bundle's `linux.namespaces[network].path` and
moves their addresses into gVisor; it must run inside that namespace, in its own mount namespace with
an empty tmpfs over /proc/sys/net/core (it takes the presence of rmem_default to mean "root namespace" and
refuses; docs/adr/0015-sandbox-network.md). Control commands (pause, checkpoint, kill, ...) work from the
root namespace once the bundle names the path.

Invariants:
- Every name and address is derived from the data directory and a slot number; callers name only
  validated sandbox ids. The one shell script is a constant; it gets its arguments as positional
  parameters, never interpolated.
- A sandbox's slot is recorded in `run/<sandbox>/network.json` (written atomically after the slot is
  complete); a slot nobody records is swept by `prepare()`; `release()` and `teardown()` remove
  namespaces, links and (teardown) the node's table and gateway link, so nothing outlives the node.
- host_addr is unique per live slot on the node and the gateway sees it as the source of every packet a
  sandbox sends (it cannot be spoofed: the edge forwards only 10.99.0.2, and the root table drops any
  packet whose source does not route back through the link it came from).
- Rulesets are applied with one `nft -f` each (atomic replace), never rule by rule.
- runsc's mount namespace holds no other file system than what it needs (see _RUNSC_ENTRY_SHELL), so a
  running sandbox never keeps another node's image or a host mount busy.
- Slots are made ahead of need by a background thread (a small pool), so creating a sandbox does not wait
  for namespaces; a slot is used by one sandbox only and is deleted with it, never recycled.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import pathlib
import re
import subprocess
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from space.core import errors
from space.node.layout import NodeLayout

if TYPE_CHECKING:
    from space.node.helper.verbs import HelperContext

NetworkMode = Literal["none", "sandbox"]

SANDBOX_ADDR = ipaddress.IPv4Address("10.99.0.2")
SANDBOX_GATEWAY = ipaddress.IPv4Address("10.99.0.1")
SANDBOX_PREFIX = 30
# Fixed MAC addresses: a restored netstack keeps its neighbour cache, so the edge must look the same in
# every slot; identical MACs on separate links do not matter. The root side uses static neighbours, so
# the slots work whatever the host's ARP sysctls say.
SANDBOX_MAC = "02:00:0a:63:00:02"
EDGE_INNER_MAC = "02:00:0a:63:00:01"
EDGE_UPLINK_MAC = "02:00:0a:63:00:03"
HOST_LINK_MAC = "02:00:0a:63:00:04"

ADDRESS_SPACE = ipaddress.IPv4Network("100.64.0.0/10")  # shared address space: not routed on the Internet
NODE_BLOCK_PREFIX = 20  # 4094 host addresses per node: the gateway's plus one per slot
NETNS_DIR = pathlib.Path("/run/netns")
EDGE_TABLE = "space_edge"
POOL_SIZE = 2
COMMAND_TIMEOUT_S = 30.0
# Runs inside the sandbox's netns and a new mount namespace (a slave of the host's: unmounts on the host,
# e.g. `ip netns del`, reach it; nothing done in it reaches the host), then becomes runsc. It hides
# rmem_default, then detaches every mount runsc does not need (everything but /, /proc, /sys, /dev,
# /run/netns and the node's data directory with its parents): the runsc process lives as long as the
# sandbox, and its copy of a private mount (another node's btrfs image, a disk the operator unmounts)
# would keep that file system busy until then. $1 is the data directory; the rest is runsc's argv.
_RUNSC_ENTRY_SHELL = r"""set -f
mount -t tmpfs -o size=4k,mode=0555 space-netcore /proc/sys/net/core || exit 1
keep="$1"; shift
drop=""
while read -r _ _ _ _ point _; do
  case "$point" in
    /|/proc|/proc/*|/sys|/sys/*|/dev|/dev/*|/run/netns|/run/netns/*) continue ;;
  esac
  case "$point/" in "$keep"/*) continue ;; esac
  case "$keep/" in "$point"/*) continue ;; esac
  drop="$drop $point"
done < /proc/self/mountinfo
[ -z "$drop" ] || umount -l $drop 2>/dev/null
exec "$@"
"""
_SLOT_NAME = re.compile(r"sp(?P<tag>[0-9a-f]{6})(?P<kind>[seh])(?P<slot>[0-9]{1,6})")


class GatewayPorts(BaseModel):
    """The node egress gateway's listening ports on gateway_addr (TCP, and UDP for dns)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    proxy: int = Field(ge=1, le=65535)
    transparent_http: int = Field(ge=1, le=65535)
    transparent_tls: int = Field(ge=1, le=65535)
    dns: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _distinct(self) -> GatewayPorts:
        values = [self.proxy, self.transparent_http, self.transparent_tls, self.dns]
        if len(set(values)) != len(values):
            raise ValueError("gateway ports must be four different ports")
        return self


class NetworkConfigureParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    ports: GatewayPorts


def node_tag(data_dir: pathlib.Path) -> str:
    return hashlib.sha256(str(data_dir).encode()).hexdigest()[:6]


def _run(argv: list[str], *, stdin: str | None = None, what: str) -> str:
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.RuntimeFailure(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        detail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise errors.RuntimeFailure(f"{what} failed: {detail}", command=argv[0])
    return proc.stdout


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
        self.table = f"space_{self.tag}"
        self.gateway_link = f"sp{self.tag}gw"
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
        return f"sp{self.tag}s{slot}"

    def edge_ns(self, slot: int) -> str:
        return f"sp{self.tag}e{slot}"

    def host_link(self, slot: int) -> str:
        return f"sp{self.tag}h{slot}"

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
        with self._lock:
            self._closing = False
            self._block = (
                ipaddress.IPv4Network(state["block"]) if state.get("block") else self._choose_block()
            )
            ports = state.get("ports")
            self._ports = GatewayPorts.model_validate(ports) if ports else None
        self._save_state()
        self._ensure_gateway_link()
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
        slots = self._existing_slots()
        with self._lock:
            slots |= self._used
            self._pool.clear()
            self._used.clear()
            self._unrecorded.clear()
            self._fresh.clear()
        self._delete_slots(slots)
        for record in self.layout.run.glob("*/network.json") if self.layout.run.exists() else []:
            record.unlink(missing_ok=True)
        if (pathlib.Path("/sys/class/net") / self.gateway_link).exists():  # idempotent: a repeat finds none
            _run(["ip", "link", "del", self.gateway_link], what="ip link del")
        # `table ...` first makes the delete succeed whether or not the table exists
        _run(["nft", "-f", "-"], stdin=f"table inet {self.table}\ndelete table inet {self.table}\n",
             what="nft delete table")  # fmt: skip

    # -- sandboxes -------------------------------------------------------------------------------------------
    def attach(self, sandbox_id: str, config: dict[str, Any]) -> list[str]:
        """Give the sandbox its slot (its own from before, else a fresh one) ready for runsc to scrape."""
        record = self._read_record(sandbox_id)
        slot = record.get("slot") if record else None
        if isinstance(slot, int) and self._slot_exists(slot):
            with self._lock:
                fresh = slot in self._fresh
                self._fresh.discard(slot)
            if not fresh:
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
        netns = NETNS_DIR / self.sandbox_ns(slot)
        set_bundle_netns(config, netns)
        return ["nsenter", f"--net={netns}", "unshare", "--mount", "--propagation", "slave",
                "sh", "-c", _RUNSC_ENTRY_SHELL, "space-runsc", str(self.layout.data_dir)]  # fmt: skip

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

    def _choose_block(self) -> ipaddress.IPv4Network:
        """A /20 of 100.64.0.0/10 that no address or route on this machine touches, starting at one derived
        from the node's tag (so the choice is stable and two nodes usually start apart)."""
        taken: list[ipaddress.IPv4Network] = []
        for entry in json.loads(_run(["ip", "-j", "-4", "addr", "show"], what="ip addr") or "[]"):
            for info in entry.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    taken.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
        for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"], what="ip route")
                                or "[]"):  # fmt: skip
            dst = route.get("dst", "")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    taken.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
        blocks = list(ADDRESS_SPACE.subnets(new_prefix=NODE_BLOCK_PREFIX))
        start = int(self.tag, 16) % len(blocks)
        for offset in range(len(blocks)):
            candidate = blocks[(start + offset) % len(blocks)]
            if not any(candidate.overlaps(net) for net in taken):
                return candidate
        raise errors.ResourceExhausted("no free address block in 100.64.0.0/10 for this node's sandboxes")

    def _ensure_gateway_link(self) -> None:
        # A veth pair stands in for a dummy interface (not every kernel has the dummy driver): it only carries
        # the gateway's address, so that the gateway can listen on it and nft can name it.
        batch = (
            f"link add {self.gateway_link} type veth peer name sp{self.tag}gp\n"
            f"link set sp{self.tag}gp up\n"
            f"link set {self.gateway_link} up\n"
            f"addr replace {self.gateway_addr}/32 dev {self.gateway_link}\n"
        )
        if (pathlib.Path("/sys/class/net") / self.gateway_link).exists():
            batch = batch.split("\n", 1)[1]
        _run(["ip", "-batch", "-"], stdin=batch, what="gateway link")

    def root_ruleset(self) -> str:
        slots = f'"sp{self.tag}h*"'
        gateway = self.gateway_addr
        lines = [
            f"table inet {self.table} {{}}",
            f"delete table inet {self.table}",
            f"table inet {self.table} {{",
            "  chain sandbox_guard {",
            "    type filter hook prerouting priority raw; policy accept;",
            f"    iifname {slots} meta nfproto ipv6 drop",
            # strict reverse-path check: a slot's packets must come from the host_addr routed to its link
            f"    iifname {slots} fib saddr . iif oif missing drop",
            "  }",
        ]
        allow: list[str] = []
        if self._ports is not None:
            p = self._ports
            tcp_ports = f"{{ {p.proxy}, {p.transparent_http}, {p.transparent_tls}, {p.dns} }}"
            lines += [
                "  chain sandbox_redirect {",
                "    type nat hook prerouting priority dstnat; policy accept;",
                f"    iifname {slots} ip daddr {gateway} tcp dport {tcp_ports} return",
                f"    iifname {slots} ip daddr {gateway} udp dport {p.dns} return",
                f"    iifname {slots} meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {gateway}:{p.dns}",
                f"    iifname {slots} tcp dport 80 dnat ip to {gateway}:{p.transparent_http}",
                f"    iifname {slots} tcp dport 443 dnat ip to {gateway}:{p.transparent_tls}",
                "  }",
            ]
            allow = [
                f"    iifname {slots} ip daddr {gateway} tcp dport {tcp_ports} accept",
                f"    iifname {slots} ip daddr {gateway} udp dport {p.dns} accept",
            ]
        lines += [
            "  chain sandbox_input {",
            "    type filter hook input priority filter; policy accept;",
            *allow,
            f"    iifname {slots} drop",
            "  }",
            "  chain sandbox_forward {",
            "    type filter hook forward priority filter; policy accept;",
            f"    iifname {slots} drop",
            f"    oifname {slots} drop",
            "  }",
            "  chain sandbox_output {",
            "    type filter hook output priority filter; policy accept;",
            f"    oifname {slots} ct state established,related accept",
            f"    oifname {slots} drop",
            "  }",
            "}",
        ]
        return "\n".join(lines) + "\n"

    def _apply_root_ruleset(self) -> None:
        _run(["nft", "-f", "-"], stdin=self.root_ruleset(), what="nft (node table)")

    # -- slots -----------------------------------------------------------------------------------------------
    def _slot_exists(self, slot: int) -> bool:
        return (
            all((NETNS_DIR / name).exists() for name in (self.sandbox_ns(slot), self.edge_ns(slot)))
            and (pathlib.Path("/sys/class/net") / self.host_link(slot)).exists()
        )

    def _existing_slots(self) -> set[int]:
        found: set[int] = set()
        names = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.is_dir() else []
        net = pathlib.Path("/sys/class/net")
        names += [p.name for p in net.iterdir()] if net.is_dir() else []
        for name in names:
            match = _SLOT_NAME.fullmatch(name)
            if match and match["tag"] == self.tag:
                found.add(int(match["slot"]))
        return found

    def _recorded_slots(self) -> set[int]:
        recorded: set[int] = set()
        for path in self.layout.run.glob("*/network.json") if self.layout.run.exists() else []:
            sandbox_id = path.parent.name
            slot = (self._read_record(sandbox_id) or {}).get("slot")
            if not isinstance(slot, int):
                continue
            if self.layout.bundle(sandbox_id).exists():
                recorded.add(slot)
            else:
                path.unlink(missing_ok=True)  # the sandbox is gone: so is its claim
        return recorded

    def _sweep(self) -> None:
        recorded = self._recorded_slots()
        stale = self._existing_slots() - recorded
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
            existing = self._existing_slots() | self._used
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
        sandbox_ns, edge_ns, host_link = self.sandbox_ns(slot), self.edge_ns(slot), self.host_link(slot)
        host_addr, gateway = self.host_addr(slot), self.gateway_addr
        edge_inner = f"{SANDBOX_GATEWAY}/{SANDBOX_PREFIX}"
        _run(["ip", "-batch", "-"], what=f"slot {slot}: namespaces", stdin=(
            f"netns add {sandbox_ns}\n"
            f"netns add {edge_ns}\n"
            f"link add eth0 netns {sandbox_ns} address {SANDBOX_MAC} type veth"
            f" peer name in0 netns {edge_ns} address {EDGE_INNER_MAC}\n"
            f"link add {host_link} address {HOST_LINK_MAC} type veth"
            f" peer name up0 netns {edge_ns} address {EDGE_UPLINK_MAC}\n"
            f"link set {host_link} up\n"
            f"route replace {host_addr}/32 dev {host_link}\n"
            f"neigh replace {host_addr} lladdr {EDGE_UPLINK_MAC} dev {host_link} nud permanent\n"
        ))  # fmt: skip
        _run(["ip", "-n", sandbox_ns, "-batch", "-"], what=f"slot {slot}: sandbox side",
             stdin=f"link set lo up\n{self._sandbox_interface_batch()}")  # fmt: skip
        _run(["ip", "-n", edge_ns, "-batch", "-"], what=f"slot {slot}: edge", stdin=(
            "link set lo up\n"
            f"addr add {edge_inner} dev in0\n"
            "link set in0 up\n"
            f"addr add {host_addr}/32 dev up0\n"
            "link set up0 up\n"
            f"route add {gateway}/32 dev up0\n"
            f"neigh replace {gateway} lladdr {HOST_LINK_MAC} dev up0 nud permanent\n"
            f"route add default via {gateway} dev up0\n"
        ))  # fmt: skip
        _run(["nsenter", f"--net={NETNS_DIR / edge_ns}", "sh", "-c",
              "echo 1 > /proc/sys/net/ipv4/ip_forward && exec nft -f -"],
             stdin=self.edge_ruleset(host_addr), what=f"slot {slot}: edge rules")  # fmt: skip
        with self._lock:
            self._fresh.add(slot)

    def edge_ruleset(self, host_addr: ipaddress.IPv4Address) -> str:
        return (
            f"table inet {EDGE_TABLE} {{\n"
            "  chain prerouting {\n"
            "    type nat hook prerouting priority dstnat; policy accept;\n"
            f'    iifname "in0" ip daddr {SANDBOX_GATEWAY} dnat ip to {self.gateway_addr}\n'
            "  }\n"
            "  chain postrouting {\n"
            "    type nat hook postrouting priority srcnat; policy accept;\n"
            f'    oifname "up0" ip saddr {SANDBOX_ADDR} snat ip to {host_addr}\n'
            "  }\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter; policy drop;\n"
            f'    iifname "in0" oifname "up0" ip saddr {SANDBOX_ADDR} accept\n'
            '    iifname "up0" oifname "in0" ct state established,related accept\n'
            "  }\n"
            "  chain input {\n"
            "    type filter hook input priority filter; policy drop;\n"
            "  }\n"
            "}\n"
        )

    @staticmethod
    def _sandbox_interface_batch() -> str:
        return (
            f"addr replace {SANDBOX_ADDR}/{SANDBOX_PREFIX} dev eth0\n"
            "link set eth0 up\n"
            f"route replace default via {SANDBOX_GATEWAY} dev eth0\n"
        )

    def _reset_sandbox_interface(self, slot: int) -> None:
        _run(["ip", "-n", self.sandbox_ns(slot), "-batch", "-"], stdin=self._sandbox_interface_batch(),
             what=f"slot {slot}: sandbox side")  # fmt: skip

    def _delete_slots(self, slots: Iterable[int]) -> None:
        slots = sorted(set(slots))
        if not slots:
            return
        batch = "".join(
            f"link del {self.host_link(s)}\nnetns del {self.sandbox_ns(s)}\nnetns del {self.edge_ns(s)}\n"
            for s in slots
        )
        # -force: keep going past parts that are already gone (a slot half made or half deleted)
        subprocess.run(["ip", "-force", "-batch", "-"], input=batch, capture_output=True, text=True,
                       timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
        left = [s for s in slots if self._slot_parts(s)]
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

    def _slot_parts(self, slot: int) -> list[str]:
        parts = [str(NETNS_DIR / n) for n in (self.sandbox_ns(slot), self.edge_ns(slot))]
        parts.append(f"/sys/class/net/{self.host_link(slot)}")
        return [p for p in parts if os.path.exists(p)]


# -- verbs (registered in space.node.helper.verbs) ----------------------------------------------------------


def _require(ctx: HelperContext) -> SandboxNetworks:
    if ctx.network is None:
        raise errors.InvalidState("this node gives sandboxes no network (network = none)", state="none",
                                  event="network")  # fmt: skip
    return ctx.network


def verb_sandbox_network(ctx: HelperContext, params: Any, _progress: Any) -> dict[str, Any]:
    """Where a sandbox's traffic comes from, as the node's egress gateway sees it."""
    return _require(ctx).describe(params.sandbox_id)


def verb_network_info(ctx: HelperContext, _params: Any, _progress: Any) -> dict[str, Any]:
    if ctx.network is None:
        return {"mode": "none"}
    return ctx.network.info()


def verb_network_configure(
    ctx: HelperContext, params: NetworkConfigureParams, _progress: Any
) -> dict[str, Any]:
    """Set the egress gateway's ports (the node table is replaced atomically; effective at once)."""
    return _require(ctx).configure(params.ports)
