"""Names and addresses of a node's sandbox network (pure: no command runs here).

One sandbox's network is a *slot* i of the node whose tag is T (from its data directory): the sandbox's
namespace spTs<i>, its edge namespace spTe<i> and the root-side link spThi; the node has one gateway link
spTgw and one nftables table `inet space_T` (space.node.helper.network draws the picture).

Invariants:
- Every name is derived from the data directory and a slot number, fits IFNAMSIZ, and differs between two
  nodes on one machine; SLOT_NAME recognises exactly the names slots are given.
- Inside the sandbox everything is the SAME in every slot (addresses, MACs), so a checkpoint restores and
  forks into any slot on any node; what tells sandboxes apart is the edge's host address.
"""

from __future__ import annotations

import hashlib
import ipaddress
import pathlib
import re
from dataclasses import dataclass

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
# A microVM's slot (docs/adr/0080-microvm-egress.md): the guest's virtio-net device takes SANDBOX_MAC and
# 10.99.0.2 (the same as a gVisor netstack), so the veth end eth0 and the tap QEMU opens are ports of a
# bridge with MACs of their own (a port whose MAC were the guest's would keep the guest's frames for itself).
MICROVM_BRIDGE = "br0"
MICROVM_TAP = "tap0"
MICROVM_UPLINK_MAC = "02:00:0a:63:00:05"
MICROVM_TAP_MAC = "02:00:0a:63:00:06"

ADDRESS_SPACE = ipaddress.IPv4Network("100.64.0.0/10")  # shared address space: not routed on the Internet
NODE_BLOCK_PREFIX = 20  # 4094 host addresses per node: the gateway's plus one per slot
NETNS_DIR = pathlib.Path("/run/netns")
EDGE_TABLE = "space_edge"
SLOT_NAME = re.compile(r"sp(?P<tag>[0-9a-f]{6})(?P<kind>[seh])(?P<slot>[0-9]{1,6})")


def node_tag(data_dir: pathlib.Path) -> str:
    return hashlib.sha256(str(data_dir).encode()).hexdigest()[:6]


@dataclass(frozen=True)
class SlotNames:
    """The names of one node's network objects (its tag decides them all)."""

    tag: str

    @property
    def table(self) -> str:
        return f"space_{self.tag}"

    @property
    def gateway_link(self) -> str:
        return f"sp{self.tag}gw"

    @property
    def gateway_peer(self) -> str:
        return f"sp{self.tag}gp"

    @property
    def host_link_glob(self) -> str:
        """What nft matches every slot's root-side link with."""
        return f'"sp{self.tag}h*"'

    def sandbox_ns(self, slot: int) -> str:
        return f"sp{self.tag}s{slot}"

    def edge_ns(self, slot: int) -> str:
        return f"sp{self.tag}e{slot}"

    def host_link(self, slot: int) -> str:
        return f"sp{self.tag}h{slot}"
