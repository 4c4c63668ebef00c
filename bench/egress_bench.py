"""Egress gateway benchmark (issue 5): added latency per HTTPS request, large-download throughput and the
time for a policy change to apply. Run: `.venv/bin/python -m bench.egress_bench [--quick]`.

Three processes, so none steals the others' interpreter: a loopback upstream (HTTP + HTTPS, test CA;
tests/support/egress_upstream.py), the gateway (this file with --serve, commands on stdin), and the client
(this process, httpx). The operator opens 127.0.0.0/8 for the gateway (a tenant policy never can).
Prints a table and writes bench/results/egress-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from bench.stats import print_table, summarize, write_json

REPO = pathlib.Path(__file__).resolve().parent.parent
TARGETS = {
    "https_direct_keepalive": "(reference)",
    "https_splice_keepalive": "added p50 <= 5 ms",
    "https_intercept_keepalive": "added p50 <= 5 ms",
    "https_direct_new_conn": "(reference)",
    "https_splice_new_conn": "added p50 <= 5 ms",
    "https_intercept_new_conn": "added p50 <= 5 ms",
    "download_direct": "(reference)",
    "download_splice": ">= 50 MB/s",
    "download_intercept": ">= 50 MB/s",
    "policy_change_applied": "p50 <= 100 ms",
}
SECRET = "bench-secret-" + "0" * 24
PLACEHOLDER = "space-cred-bench-" + "1" * 24


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------------------
# gateway process


async def serve(ca_dir: pathlib.Path, trust: pathlib.Path) -> None:
    import ipaddress

    from space.node.egress import Credential, EgressGateway, EgressPolicy, StaticCredentials, StaticResolver

    credential = Credential(name="bench", value=SECRET, hosts=["intercept.test"], placeholder=PLACEHOLDER)
    gateway = EgressGateway(
        ca_dir=ca_dir,
        credentials=StaticCredentials({"sb-bench": [credential]}),
        audit=lambda record: None,
        resolver=StaticResolver({"intercept.test": ["127.0.0.1"], "splice.test": ["127.0.0.1"]}),
        listen_host="127.0.0.1",
        trust_store=trust,
        operator_allowed_networks=[ipaddress.ip_network("127.0.0.0/8")],
    )
    await gateway.start()
    allow = EgressPolicy(allow=["intercept.test", "splice.test"])
    deny = EgressPolicy(allow=["intercept.test"])
    gateway.set_policy("sb-bench", "127.0.0.1", allow)
    print(json.dumps({"ports": gateway.ports, "ca": gateway.ca_certificate_pem.decode()}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "quit":
            break
        gateway.set_policy("sb-bench", "127.0.0.1", deny if line == "deny" else allow)
        sys.stdout.write("ok\n")
        sys.stdout.flush()
    await gateway.close()


# ---------------------------------------------------------------------------------------------------------
# client


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def latency(
    factories: dict[str, Any], urls: dict[str, str], n: int, *, new_connection: bool, headers: dict[str, str]
) -> dict[str, list[float]]:
    """Interleaved (direct, splice, intercept) rounds, so load from elsewhere hits all kinds alike."""
    samples: dict[str, list[float]] = {kind: [] for kind in factories}
    clients = {kind: factory() for kind, factory in factories.items()}
    for kind, client in clients.items():  # warm up (connect, leaf certificate minted)
        client.get(urls[kind], headers=headers).raise_for_status()
    for _ in range(n):
        for kind, factory in factories.items():
            if new_connection:
                clients[kind].close()
                clients[kind] = factory()
            start = time.perf_counter()
            response = clients[kind].get(urls[kind], headers=headers)
            samples[kind].append(_ms(start))
            response.raise_for_status()
    for client in clients.values():
        client.close()
    return samples


def throughput(client: httpx.Client, url: str, size: int, headers: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    received = 0
    with client.stream("GET", url, params={"n": size}, headers=headers) as response:
        response.raise_for_status()
        for chunk in response.iter_raw(1 << 20):
            received += len(chunk)
    seconds = time.perf_counter() - start
    assert received == size, (received, size)
    return {"mb_per_s": round(size / seconds / 1e6, 1), "bytes": size, "seconds": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ca-dir", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--trust", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.ca_dir, args.trust))
        return
    sys.path.insert(0, str(REPO))
    from tests.support.egress_net import UpstreamCA, wait_port

    n = 100 if args.quick else 400
    size = (64 if args.quick else 512) << 20
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-egress-bench-", dir="/var/tmp"))
    upstream_ca = UpstreamCA(workdir)
    cert = upstream_ca.issue("upstream.pem", ["intercept.test", "splice.test"], ["127.0.0.1"])
    http_port, https_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    upstream = subprocess.Popen(
        [
            sys.executable, "-m", "tests.support.egress_upstream", "--name", "bench", "--bind", "127.0.0.1",
            "--http-port", str(http_port), "--https-port", str(https_port), "--cert", str(cert),
            "--log", "/dev/null",
        ],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    gateway = subprocess.Popen(
        [sys.executable, "-m", "bench.egress_bench", "--serve", "--ca-dir", str(workdir / "ca"),
         "--trust", str(upstream_ca.ca_file)],
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    results: dict[str, Any] = {}
    try:
        assert gateway.stdout is not None and gateway.stdin is not None
        hello = json.loads(gateway.stdout.readline())
        ports = hello["ports"]
        trust = workdir / "trust.pem"
        trust.write_text(hello["ca"] + upstream_ca.ca_file.read_text())
        wait_port("127.0.0.1", https_port)
        context = ssl.create_default_context(cafile=str(trust))
        proxy = f"http://127.0.0.1:{ports['proxy']}"

        def direct() -> httpx.Client:
            return httpx.Client(verify=context, timeout=30)

        def proxied() -> httpx.Client:
            return httpx.Client(verify=context, timeout=30, proxy=proxy)

        auth = {"Authorization": f"Bearer {PLACEHOLDER}"}
        urls = {
            "direct": f"https://127.0.0.1:{https_port}/",
            "splice": f"https://splice.test:{https_port}/",
            "intercept": f"https://intercept.test:{https_port}/",
        }
        factories = {"direct": direct, "splice": proxied, "intercept": proxied}
        for new_connection, suffix in ((False, "keepalive"), (True, "new_conn")):
            count = n if not new_connection else max(50, n // 4)
            by_kind = latency(factories, urls, count, new_connection=new_connection, headers=auth)
            base = summarize(by_kind["direct"])["p50_ms"]
            for kind, samples in by_kind.items():
                row = summarize(samples)
                if kind != "direct":
                    row["added_p50_ms"] = round(row["p50_ms"] - base, 2)
                results[f"https_{kind}_{suffix}"] = row
        for kind in ("direct", "splice", "intercept"):
            runs = []
            for _ in range(3):
                with factories[kind]() as client:
                    runs.append(throughput(client, urls[kind] + "bytes", size, auth))
            runs.sort(key=lambda r: r["mb_per_s"])
            results[f"download_{kind}"] = {**runs[1], "runs_mb_per_s": [r["mb_per_s"] for r in runs]}
        # policy change: time from the command to the first request decided under the new policy
        samples = []
        plain = f"http://splice.test:{http_port}/"
        with httpx.Client(proxy=proxy, timeout=10) as client:
            for index in range(50 if args.quick else 100):
                deny = index % 2 == 0
                start = time.perf_counter()
                gateway.stdin.write("deny\n" if deny else "allow\n")
                gateway.stdin.flush()
                assert gateway.stdout.readline().strip() == "ok"
                status = client.get(plain).status_code
                samples.append(_ms(start))
                assert status == (403 if deny else 200), status
        results["policy_change_applied"] = summarize(samples)
    finally:
        if gateway.stdin is not None:
            try:
                gateway.stdin.write("quit\n")
                gateway.stdin.flush()
            except BrokenPipeError:
                pass
        for process in (gateway, upstream):
            try:
                process.wait(5) if process is gateway else process.terminate()
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    print_table(results, TARGETS)
    path = write_json(results, "egress")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
