"""What per-sandbox networks cost on the create path (docs/adr/0015-sandbox-network.md). Run as root:
`python -m bench.network_bench [-n 15]`.

Measures, for network = "none" and "sandbox" on two otherwise identical nodes running side by side and
measured in turn (so background load hits both alike): warm create (restore of the
template's checkpoint) and cold create (boot) to the first exec answered, and stop+start. With the
network on it also times the parts: making one slot (two namespaces, two veth pairs, the edge's nft
ruleset), re-addressing a used slot before a restart, deleting a slot, and replacing the node's table.
Writes bench/results/network-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import tempfile
import time
from typing import Any

from bench.stats import print_table, summarize, write_json
from space.node.helper.network import SandboxNetworks
from space.node.helper.params import GatewayPorts
from space.node.layout import NodeLayout
from space.node.local import LocalNode


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


async def lifecycle(n: int) -> dict[str, list[float]]:
    """Both nodes up at once and measured in turn, so background load hits both alike."""
    nodes: dict[str, LocalNode] = {}
    agents = {}
    samples: dict[str, list[float]] = {
        f"{kind}[{network}]": [] for kind in ("create_warm", "create_cold", "stop_start")
        for network in ("none", "sandbox")
    }  # fmt: skip
    try:
        for network in ("none", "sandbox"):
            data_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"space-bench-net-{network}-", dir="/var/tmp"))
            nodes[network] = LocalNode(data_dir, network=network, cgroup_parent=f"space-bench-{network}")
            agents[network] = await nodes[network].start(progress=lambda line: None)
        for _ in range(n):
            for network, agent in agents.items():
                for kind, warm in (("create_warm", True), ("create_cold", False)):
                    mark = time.perf_counter()
                    handle = await agent.create("python", warm=warm)
                    await handle.session.exec(["true"])
                    samples[f"{kind}[{network}]"].append(_ms(mark))
                    if kind == "create_cold":
                        mark = time.perf_counter()
                        await agent.stop(handle.sandbox_id)
                        await agent.start(handle.sandbox_id)
                        await handle.session.exec(["true"])
                        samples[f"stop_start[{network}]"].append(_ms(mark))
                    await agent.delete(handle.sandbox_id)
    finally:
        for network, node in nodes.items():
            if network in agents:
                await agents[network].delete_all()
            await node.stop(purge=True)
    return samples


def slot_parts(n: int) -> dict[str, list[float]]:
    """The network module alone (no runsc), on a scratch data directory."""
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-slots-", dir="/var/tmp"))
    networks = SandboxNetworks(NodeLayout(data_dir), pool_size=0)
    samples: dict[str, list[float]] = {"slot_create": [], "slot_readdress": [], "slot_delete": [],
                                       "node_table_replace": []}  # fmt: skip
    networks.prepare()
    try:
        ports = GatewayPorts(proxy=3128, transparent_http=3129, transparent_tls=3130, dns=3053)
        for i in range(n):
            mark = time.perf_counter()
            networks._create_slot(i)  # the parts themselves, so private methods
            samples["slot_create"].append(_ms(mark))
        for i in range(n):
            mark = time.perf_counter()
            networks._reset_sandbox_interface(i)
            samples["slot_readdress"].append(_ms(mark))
            mark = time.perf_counter()
            networks.configure(ports)
            samples["node_table_replace"].append(_ms(mark))
        for i in range(n):
            mark = time.perf_counter()
            networks._delete_slots({i})
            samples["slot_delete"].append(_ms(mark))
    finally:
        networks.teardown()
        (data_dir / "network.json").unlink(missing_ok=True)
        data_dir.rmdir()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=15)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name, values in slot_parts(args.n).items():
        results[name] = summarize(values)
    for name, values in asyncio.run(lifecycle(args.n)).items():
        results[name] = summarize(values)
    print_table(results, {})
    print(write_json(results, "network"))


if __name__ == "__main__":
    main()
