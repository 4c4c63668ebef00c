"""The qemu driver's microVMs (issue 15, docs/adr/0068-qemu-microvm-driver.md). Run as root:
`python -m bench.qemu_bench [--quick] [--json]`.

Starts its own node (root helper + btrfs) in a fresh data directory, makes the `python` template's microVM
checkpoint once (one cold boot: reported, not a target), measures through the QemuDriver and the helper's
microvm.* verbs, and purges everything. Under TCG where /dev/kvm runs no hardware guests (reported).
`--network sandbox` gives every microVM its network slot (ADR 0080); the default is none.
- create_first_answer: QemuDriver.create_warm (reflink the template's disk, start QEMU with -incoming,
  load the template's memory image, cont) until `exec true` answered;
- exec_true: `exec true` in a running microVM;
- full_checkpoint_512mb: QMP stop + migrate of a 512 MB guest to a file + reflink of its disk, then cont.
Prints a table and writes bench/results/qemu-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import tempfile
import time
from typing import Any

from bench.stats import print_table, summarize, write_json
from space.core import ids
from space.node.agent.guest import GuestSession
from space.node.agent.helper_client import HelperClient
from space.node.drivers.base import SandboxSpec
from space.node.drivers.qemu import QemuDriver
from space.node.local import LocalNode

TARGETS = {
    "create_first_answer": "p50 <= 400 ms under TCG",
    "exec_true": "p50 <= 60 ms under TCG",
    "full_checkpoint_512mb": "<= 1 s under TCG",
}


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


async def measure(driver: QemuDriver, rounds: int) -> dict[str, dict[str, Any]]:
    t0 = time.perf_counter()
    described = await driver.ensure_template("python")
    template_ms = _ms(t0)
    samples: dict[str, list[float]] = {name: [] for name in TARGETS}
    for _ in range(rounds):
        sandbox_id = ids.new_sandbox_id()
        start = time.perf_counter()
        channel = await driver.create_warm(SandboxSpec(sandbox_id, "python"))
        assert channel is not None
        session = GuestSession(channel)
        assert (await session.exec(["true"])).exit_code == 0
        samples["create_first_answer"].append(_ms(start))
        try:
            for _ in range(5):
                start = time.perf_counter()
                assert (await session.exec(["true"])).exit_code == 0
                samples["exec_true"].append(_ms(start))
            start = time.perf_counter()
            await driver.checkpoint(sandbox_id, ids.new_snapshot_id())
            samples["full_checkpoint_512mb"].append(_ms(start))
        finally:
            await channel.close()
            await driver.destroy(sandbox_id)
    results = {name: summarize(values) for name, values in samples.items()}
    results["template_checkpoint"] = {"once_ms": round(template_ms, 1), **described["microvm"]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    # sandbox: every microVM on its network slot (a tap bridged to the slot's veth end, ADR 0080), so
    # create includes wiring the slot; none: the empty namespace (the driver's cost alone)
    parser.add_argument("--network", choices=("none", "sandbox"), default="none")
    args = parser.parse_args()
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-qemu-", dir="/var/tmp"))
    node = LocalNode(data_dir, network=args.network)

    async def run() -> dict[str, dict[str, Any]]:
        await node.start(progress=lambda _line: None)
        driver = QemuDriver(node.layout, HelperClient(str(node.layout.helper_socket)))
        try:
            return await measure(driver, 3 if args.quick else 10)
        finally:
            await driver.close()
            await node.stop(purge=True)

    results = asyncio.run(run())
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print_table(results, TARGETS)
        print("template_checkpoint:", results["template_checkpoint"])
    print("written:", write_json(results, "qemu"))


if __name__ == "__main__":
    main()
