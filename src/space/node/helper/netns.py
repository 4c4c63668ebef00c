"""The commands that make and remove a node's network namespaces, veth pairs and gateway link, and the
prefix that starts runsc inside a sandbox's namespace (root helper only).

runsc scrapes the interfaces of the namespace named in the bundle's `linux.namespaces[network].path` and
moves their addresses into gVisor; it must run inside that namespace, in its own mount namespace with
an empty tmpfs over /proc/sys/net/core (it takes the presence of rmem_default to mean "root namespace" and
refuses; docs/adr/0015-sandbox-network.md). Control commands (pause, checkpoint, kill, ...) work from the
root namespace once the bundle names the path.

Invariants:
- Nothing here keeps state: space.node.helper.network decides which slots exist; these functions only
  run `ip`, `nsenter` and `nft` with argv lists and batches built from SlotNames and addresses.
- The one shell script is a constant; it gets its arguments as positional parameters, never interpolated.
- runsc's mount namespace holds no other file system than what it needs (see RUNSC_ENTRY_SHELL), so a
  running sandbox never keeps another node's image or a host mount busy.
- Deleting slots keeps going past parts that are already gone and reports what is left.
- A node's address block is chosen and its gateway address put on a link under one machine-wide lock
  (`claim_block`), so nodes whose helpers start together never choose the same block.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import pathlib
import subprocess
from collections.abc import Callable, Iterable, Iterator

from space.core import errors
from space.node.helper import nftables
from space.node.helper.netaddr import (
    ADDRESS_SPACE,
    EDGE_INNER_MAC,
    EDGE_UPLINK_MAC,
    HOST_LINK_MAC,
    MICROVM_BRIDGE,
    MICROVM_TAP,
    MICROVM_TAP_MAC,
    MICROVM_UPLINK_MAC,
    NETNS_DIR,
    NODE_BLOCK_PREFIX,
    SANDBOX_ADDR,
    SANDBOX_GATEWAY,
    SANDBOX_MAC,
    SANDBOX_PREFIX,
    SLOT_NAME,
    SlotNames,
)

COMMAND_TIMEOUT_S = 30.0
#: Held by a helper from choosing its node's address block until the block's gateway address is on a link.
BLOCK_LOCK = pathlib.Path("/run/lock/space-address-blocks.lock")
#: The network interfaces of the CALLER's network namespace (/proc/net is /proc/self/net). Not
#: /sys/class/net: sysfs shows the namespace of whoever mounted it, so a node whose helper runs in a network
#: namespace of its own (one "machine" of several on a host, a container) would see the host's links.
PROC_NET_DEV = pathlib.Path("/proc/net/dev")
# Runs inside the sandbox's netns and a new mount namespace (a slave of the host's: unmounts on the host,
# e.g. `ip netns del`, reach it; nothing done in it reaches the host), then becomes runsc. It hides
# rmem_default, then detaches every mount runsc does not need (everything but /, /proc, /sys, /dev,
# /run/netns and the node's data directory with its parents): the runsc process lives as long as the
# sandbox, and its copy of a private mount (another node's btrfs image, a disk the operator unmounts)
# would keep that file system busy until then. $1 is the data directory; the rest is runsc's argv.
RUNSC_ENTRY_SHELL = r"""set -f
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


def run(argv: list[str], *, stdin: str | None = None, what: str) -> str:
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


def runsc_entry(netns: pathlib.Path, data_dir: pathlib.Path) -> list[str]:
    """The argv prefix that starts runsc inside `netns` (runsc's own argv follows it)."""
    return ["nsenter", f"--net={netns}", "unshare", "--mount", "--propagation", "slave",
            "sh", "-c", RUNSC_ENTRY_SHELL, "space-runsc", str(data_dir)]  # fmt: skip


# -- the node's address block and gateway link --------------------------------------------------------------
def _networks_in_use() -> list[ipaddress.IPv4Network]:
    taken: list[ipaddress.IPv4Network] = []
    for entry in json.loads(run(["ip", "-j", "-4", "addr", "show"], what="ip addr") or "[]"):
        for info in entry.get("addr_info", []):
            with contextlib.suppress(ValueError, KeyError):
                taken.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"], what="ip route")
                            or "[]"):  # fmt: skip
        dst = route.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    return taken


def choose_block(tag: str) -> ipaddress.IPv4Network:
    """A /20 of 100.64.0.0/10 that no address or route on this machine touches, starting at one derived
    from the node's tag (so the choice is stable and two nodes usually start apart)."""
    taken = _networks_in_use()
    blocks = list(ADDRESS_SPACE.subnets(new_prefix=NODE_BLOCK_PREFIX))
    start = int(tag, 16) % len(blocks)
    for offset in range(len(blocks)):
        candidate = blocks[(start + offset) % len(blocks)]
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise errors.ResourceExhausted("no free address block in 100.64.0.0/10 for this node's sandboxes")


@contextlib.contextmanager
def _block_lock() -> Iterator[None]:
    BLOCK_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(BLOCK_LOCK, "a") as handle:  # flock needs the descriptor of an open file
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def claim_block(tag: str, claim: Callable[[ipaddress.IPv4Network], None]) -> ipaddress.IPv4Network:
    """Choose a free block (`choose_block`) and `claim` it (put its gateway address on a link) as one step
    on this machine: a block is free when no address or route touches it, so until the claim is done
    another helper starting at the same moment would see it free too and take the same one."""
    with _block_lock():
        block = choose_block(tag)
        claim(block)
    return block


def link_names() -> set[str]:
    """The names of the links in this process's network namespace."""
    try:
        lines = PROC_NET_DEV.read_text().splitlines()[2:]  # two header lines
    except OSError as exc:
        raise errors.RuntimeFailure(f"cannot list network links: {exc}") from exc
    return {line.split(":", 1)[0].strip() for line in lines if ":" in line}


def ensure_gateway_link(names: SlotNames, gateway: ipaddress.IPv4Address) -> None:
    # A veth pair stands in for a dummy interface (not every kernel has the dummy driver): it only carries
    # the gateway's address, so that the gateway can listen on it and nft can name it.
    batch = (
        f"link add {names.gateway_link} type veth peer name {names.gateway_peer}\n"
        f"link set {names.gateway_peer} up\n"
        f"link set {names.gateway_link} up\n"
        f"addr replace {gateway}/32 dev {names.gateway_link}\n"
    )
    if names.gateway_link in link_names():
        batch = batch.split("\n", 1)[1]
    run(["ip", "-batch", "-"], stdin=batch, what="gateway link")


def remove_gateway_link_and_table(names: SlotNames) -> None:
    if names.gateway_link in link_names():  # idempotent: a repeat finds none
        run(["ip", "link", "del", names.gateway_link], what="ip link del")
    run(["nft", "-f", "-"], stdin=nftables.delete_root_table(names), what="nft delete table")


# -- slots ------------------------------------------------------------------------------------------------
def slot_exists(names: SlotNames, slot: int) -> bool:
    return (
        all((NETNS_DIR / name).exists() for name in (names.sandbox_ns(slot), names.edge_ns(slot)))
        and names.host_link(slot) in link_names()
    )


def existing_slots(names: SlotNames) -> set[int]:
    """Every slot of this node that has any part left (namespace or link)."""
    found: set[int] = set()
    entries = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.is_dir() else []
    entries += sorted(link_names())
    for name in entries:
        match = SLOT_NAME.fullmatch(name)
        if match and match["tag"] == names.tag:
            found.add(int(match["slot"]))
    return found


def create_slot(
    names: SlotNames, slot: int, host_addr: ipaddress.IPv4Address, gateway: ipaddress.IPv4Address
) -> None:
    sandbox_ns, edge_ns, host_link = names.sandbox_ns(slot), names.edge_ns(slot), names.host_link(slot)
    edge_inner = f"{SANDBOX_GATEWAY}/{SANDBOX_PREFIX}"
    run(["ip", "-batch", "-"], what=f"slot {slot}: namespaces", stdin=(
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
    run(["ip", "-n", sandbox_ns, "-batch", "-"], what=f"slot {slot}: sandbox side",
        stdin=f"link set lo up\n{sandbox_interface_batch()}")  # fmt: skip
    run(["ip", "-n", edge_ns, "-batch", "-"], what=f"slot {slot}: edge", stdin=(
        "link set lo up\n"
        f"addr add {edge_inner} dev in0\n"
        "link set in0 up\n"
        f"addr add {host_addr}/32 dev up0\n"
        "link set up0 up\n"
        f"route add {gateway}/32 dev up0\n"
        f"neigh replace {gateway} lladdr {HOST_LINK_MAC} dev up0 nud permanent\n"
        f"route add default via {gateway} dev up0\n"
    ))  # fmt: skip
    run(["nsenter", f"--net={NETNS_DIR / edge_ns}", "sh", "-c",
         "echo 1 > /proc/sys/net/ipv4/ip_forward && exec nft -f -"],
        stdin=nftables.edge_ruleset(gateway, host_addr), what=f"slot {slot}: edge rules")  # fmt: skip


def sandbox_interface_batch() -> str:
    return (
        f"addr replace {SANDBOX_ADDR}/{SANDBOX_PREFIX} dev eth0\n"
        "link set eth0 up\n"
        f"route replace default via {SANDBOX_GATEWAY} dev eth0\n"
    )


def microvm_tap_exists(names: SlotNames, slot: int) -> bool:
    shown = subprocess.run(["ip", "-n", names.sandbox_ns(slot), "link", "show", "dev", MICROVM_TAP],
                           capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
    return shown.returncode == 0


def wire_microvm_tap(names: SlotNames, slot: int, uid: int, *, fresh: bool) -> None:
    """Make the slot's sandbox namespace a wire for a microVM (docs/adr/0080-microvm-egress.md): eth0 loses
    the address gVisor would take over (the guest's kernel has it) and joins a bridge with a tap owned by
    `uid`, which QEMU opens; the edge, its rules and the node table stay exactly as for gVisor. One `ip`
    batch on a `fresh` slot; otherwise what a half-made wire left is removed first."""
    sandbox_ns = names.sandbox_ns(slot)
    if not fresh:
        subprocess.run(["ip", "-n", sandbox_ns, "-force", "-batch", "-"], capture_output=True, text=True,
                       input=f"link del {MICROVM_TAP}\nlink del {MICROVM_BRIDGE}\n",
                       timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
    # addrgenmode none: the bridge and the tap get no IPv6 link-local address, so the guest finds no host
    # stack to talk to in this namespace (eth0 has no IPv4 address either, and its frames go to the bridge).
    run(["ip", "-n", sandbox_ns, "-batch", "-"], what=f"slot {slot}: microVM tap", stdin=(
        "addr flush dev eth0\n"
        "link set eth0 down\n"
        f"link set eth0 address {MICROVM_UPLINK_MAC}\n"
        f"link add {MICROVM_BRIDGE} type bridge forward_delay 0 stp_state 0\n"
        f"link set {MICROVM_BRIDGE} addrgenmode none\n"
        f"link set eth0 master {MICROVM_BRIDGE}\n"
        f"tuntap add dev {MICROVM_TAP} mode tap user {uid} group {uid}\n"
        f"link set {MICROVM_TAP} address {MICROVM_TAP_MAC} addrgenmode none\n"
        f"link set {MICROVM_TAP} master {MICROVM_BRIDGE}\n"
        "link set eth0 up\n"
        f"link set {MICROVM_TAP} up\n"
        f"link set {MICROVM_BRIDGE} up\n"
    ))  # fmt: skip


def reset_sandbox_interface(names: SlotNames, slot: int) -> None:
    run(["ip", "-n", names.sandbox_ns(slot), "-batch", "-"], stdin=sandbox_interface_batch(),
        what=f"slot {slot}: sandbox side")  # fmt: skip


def delete_slots(names: SlotNames, slots: Iterable[int]) -> list[int]:
    """Remove the slots' namespaces and links; the slots of which some part is still left."""
    ordered = sorted(set(slots))
    if not ordered:
        return []
    batch = "".join(
        f"link del {names.host_link(s)}\nnetns del {names.sandbox_ns(s)}\nnetns del {names.edge_ns(s)}\n"
        for s in ordered
    )
    # -force: keep going past parts that are already gone (a slot half made or half deleted)
    subprocess.run(["ip", "-force", "-batch", "-"], input=batch, capture_output=True, text=True,
                   timeout=COMMAND_TIMEOUT_S, check=False)  # fmt: skip
    return [s for s in ordered if _slot_parts(names, s)]


def _slot_parts(names: SlotNames, slot: int) -> list[str]:
    parts = [str(NETNS_DIR / n) for n in (names.sandbox_ns(slot), names.edge_ns(slot))]
    found = [p for p in parts if os.path.exists(p)]
    if names.host_link(slot) in link_names():
        found.append(f"link {names.host_link(slot)}")
    return found
