"""Noisy neighbours (issue 11): a noisy sandbox must not push a quiet neighbour's exec p99 above 2x its quiet
value. Run as root: `python -m bench.neighbours_bench [--seconds 15] [--kinds cpu,memory,...]`.

One real node (LocalNode: root helper, runsc, btrfs; the agent in this process, like bench/node_bench.py),
two sandboxes with the default limits (SandboxLimits: 1 CPU, 512 MiB, 512 pids). The quiet one runs
`true` again and again (one exec every INTERVAL_S, as tests/support/neighbours.py's probe does); for
each kind of noise the bench measures the quiet sandbox's exec latency in a quiet window, then in a window
of the same length while the noisy sandbox makes that noise, alternating `--rounds` times, so a machine
whose load drifts (other jobs) is compared with itself seconds apart. The noise, all inside the noisy sandbox:

  cpu        4 busy loops (more than its CPU limit)
  memory     allocate and touch 400 MiB, free, again (near its memory limit; page faults, reclaim)
  disk       write 256 MiB with fsync, delete, again (block I/O on the node's btrfs)
  processes  fork/exec churn: 4 shells running /bin/true in a loop
  network    a TCP stream over the sandbox's loopback and a UDP flood to its DNS resolver (the node's
             egress gateway, a shared component)

Prints a table (p50/p99/max quiet vs noisy, the ratio of the p99s) and writes
bench/results/neighbours-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import tempfile
import time
from typing import Any

from bench.stats import summarize, write_json
from space.core import errors
from space.node.agent.agent import SandboxHandle
from space.node.local import LocalNode

INTERVAL_S = 0.05
TARGET_RATIO = 2.0
MEMORY_CHURN = """
import time
end = time.monotonic() + float(__import__('os').environ['SECONDS_'])
while time.monotonic() < end:
    block = bytearray(400 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    del block
"""
NETWORK_NOISE = """
import os, socket, threading, time
end = time.monotonic() + float(os.environ['SECONDS_'])
server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen(1)
def sink():
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
threading.Thread(target=sink, daemon=True).start()
client = socket.create_connection(server.getsockname())
resolver = '127.0.0.53'
for line in open('/etc/resolv.conf'):
    if line.startswith('nameserver'):
        resolver = line.split()[1]
        break
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
query = bytes.fromhex('123401000001000000000000') + b'\\x05noise\\x04test\\x00' + bytes.fromhex('00010001')
chunk = b'x' * (1 << 16)
sent = 0
while time.monotonic() < end:
    client.sendall(chunk)
    try:
        udp.sendto(query, (resolver, 53))
    except OSError:
        pass
    sent += 1
print(sent)
"""


def noise_command(kind: str, seconds: float) -> list[str]:
    """The command the noisy sandbox runs for `seconds` (it ends by itself)."""
    s = f"{seconds:.0f}"
    shell = {
        "cpu": f"for i in 1 2 3 4; do timeout {s} sh -c 'while :; do :; done' & done; wait",
        "disk": f"end=$(($(date +%s)+{s})); while [ $(date +%s) -lt $end ]; do "
        "dd if=/dev/zero of=/work/noise bs=1M count=256 conv=fsync 2>/dev/null; rm -f /work/noise; done",
        "processes": f"for i in 1 2 3 4; do timeout {s} sh -c 'while :; do /bin/true; done' & done; wait",
    }
    if kind in shell:
        return ["sh", "-c", shell[kind]]
    script = {"memory": MEMORY_CHURN, "network": NETWORK_NOISE}[kind]
    return ["env", f"SECONDS_={s}", "python3", "-c", script]


KINDS = ("cpu", "memory", "disk", "processes", "network")


async def probe(quiet: SandboxHandle, seconds: float) -> tuple[list[float], list[str]]:
    """Exec `true` in the quiet sandbox every INTERVAL_S for `seconds`; latencies (ms) and failures."""
    samples: list[float] = []
    failures: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        try:
            answer = await quiet.session.exec(["true"], timeout=30)
            if answer.exit_code != 0:
                failures.append(f"exit {answer.exit_code}")
        except errors.SpaceError as exc:
            failures.append(repr(exc)[:200])
        samples.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(INTERVAL_S)
    return samples, failures


async def one_kind(
    quiet: SandboxHandle, noisy: SandboxHandle, kind: str, seconds: float, rounds: int
) -> dict[str, Any]:
    """`rounds` times: a quiet window, then a noisy one (the noise starts a second before the probe, to
    be in full swing, and ends by itself a second after it); each window seconds/rounds long. Alternating
    compares the neighbour with itself seconds apart, so other load on the machine drifts less between
    the two sides."""
    alone: list[float] = []
    loud: list[float] = []
    failures: list[str] = []
    outcomes = []
    window = seconds / rounds
    for _ in range(rounds):
        samples, failed = await probe(quiet, window)
        alone += samples
        failures += failed
        command = noise_command(kind, window + 2)
        noise = asyncio.create_task(noisy.session.exec(command, timeout=window + 60))
        await asyncio.sleep(1.0)
        try:
            samples, failed = await probe(quiet, window)
            loud += samples
            failures += failed
        finally:
            outcome = "?"
            with contextlib.suppress(errors.SpaceError):
                answer = await noise
                outcome = f"exit {answer.exit_code}"
            outcomes.append(outcome)
    quiet_row, noisy_row = summarize(alone), summarize(loud)
    return {
        "quiet": quiet_row,
        "noisy": noisy_row,
        "p99_ratio": round(noisy_row["p99_ms"] / quiet_row["p99_ms"], 2),
        "p50_ratio": round(noisy_row["p50_ms"] / quiet_row["p50_ms"], 2),
        "failures": failures,
        "noise": outcomes,
    }


async def run(
    kinds: list[str], seconds: float, rounds: int, data_dir: pathlib.Path, platform: str
) -> dict[str, Any]:
    node = LocalNode(data_dir, platform=platform, cgroup_parent="space-bench-neighbours")
    agent = await node.start(progress=lambda line: print(f"  | {line}", flush=True))
    results: dict[str, Any] = {}
    try:
        quiet = await agent.create("python")
        noisy = await agent.create("python")
        await probe(quiet, 2.0)  # warm the exec path
        for kind in kinds:
            print(f"noise: {kind} ...", flush=True)
            results[kind] = await one_kind(quiet, noisy, kind, seconds, rounds)
            print(f"  {_row(kind, results[kind])}", flush=True)
    finally:
        await node.stop(purge=True)
    return results


def _row(kind: str, r: dict[str, Any]) -> str:
    q, n = r["quiet"], r["noisy"]
    verdict = "ok" if r["p99_ratio"] <= TARGET_RATIO else f"ABOVE {TARGET_RATIO}x"
    return (
        f"{kind:<10} quiet p50 {q['p50_ms']:>6.1f} p99 {q['p99_ms']:>7.1f} | noisy p50 {n['p50_ms']:>6.1f} "
        f"p99 {n['p99_ms']:>7.1f} | p99 x{r['p99_ratio']:<5} {verdict}"
        f"{'  failures: ' + str(r['failures'][:2]) if r['failures'] else ''}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="quiet (and noisy) time per kind")
    parser.add_argument("--rounds", type=int, default=3, help="quiet/noisy alternations per kind")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--platform", default="ptrace", choices=["systrap", "ptrace"])
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds: {sorted(unknown)}")
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-neighbours-", dir="/var/tmp"))
    load_before = os.getloadavg()
    results = asyncio.run(run(kinds, args.seconds, args.rounds, data_dir, args.platform))
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()}, "target_p99_ratio": TARGET_RATIO,
              "kinds": results}  # fmt: skip
    path = write_json(report, "neighbours")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for kind, row in results.items():
            print(_row(kind, row))
        print(f"machine load average before/after: {load_before} / {report['machine']['loadavg_after']}")
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
