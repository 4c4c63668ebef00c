"""Egress from a real sandbox (issue 5): what the node's egress wiring costs, measured from inside gVisor.
Run as root: `.venv/bin/python -m bench.egress_sandbox_bench [--quick]`.

One node with network = "sandbox" and its gateway (space.node.agent.egress_wiring), upstream test servers in
their own network namespaces (tests/support/egress_net.py; the operator opens 10.98.0.0/16 for them).
Measured:
- https_*: per-request latency through the explicit proxy from inside the sandbox (python http.client with a
  CONNECT tunnel), keep-alive and one new connection per request, spliced (no credential bound to the host)
  and intercepted (a bound credential: TLS terminated with the node's CA, the value injected); reference:
  the same client on the host, straight to the upstream (no sandbox, no gateway);
- download_*: a large body through the same paths (MB/s);
- create_warm: sandbox create with the wiring (policy applied, CA/resolv.conf written, proxy env);
- policy_change_applied: EgressWiring.apply (the node-side part of PUT /v1/sandboxes/{id}/egress).
Prints a table and writes bench/results/egress-sandbox-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from tests.support.egress_net import UpstreamCA, start_upstream

from bench.stats import print_table, summarize, write_json
from space.core.ids import new_sandbox_id
from space.node.agent.egress_sandbox import CA_BUNDLE_PATH
from space.node.agent.egress_settings import EgressRequest, EgressSettings
from space.node.agent.egress_wiring import install
from space.node.egress import Credential, StaticCredentials, StaticResolver
from space.node.local import LocalNode

TARGETS = {
    "https_host_direct_keepalive": "(reference)",
    "https_splice_keepalive": "added p50 <= 5 ms",
    "https_intercept_keepalive": "added p50 <= 5 ms",
    "https_host_direct_new_conn": "(reference)",
    "https_splice_new_conn": "added p50 <= 5 ms",
    "https_intercept_new_conn": "added p50 <= 5 ms",
    "download_host_direct": "(reference)",
    "download_splice": ">= 50 MB/s",
    "download_intercept": ">= 50 MB/s",
    "create_warm": "(with egress wiring)",
    "policy_change_applied": "p50 <= 100 ms",
}

# Runs inside the sandbox (or on the host for the reference): argv = JSON settings; prints JSON samples.
CLIENT = r"""
import http.client, json, os, ssl, sys, time
cfg = json.loads(sys.argv[1])
ctx = ssl.create_default_context(cafile=cfg.get("cafile"))
headers = {k: v.format(**os.environ) for k, v in cfg.get("headers", {}).items()}
def connect():
    if cfg.get("proxy"):
        c = http.client.HTTPSConnection(cfg["proxy"][0], cfg["proxy"][1], context=ctx, timeout=60)
        c.set_tunnel(cfg["host"], 443)
    else:
        c = http.client.HTTPSConnection(cfg["host"], 443, context=ctx, timeout=60)
    return c
def get(c, path):
    c.request("GET", path, headers=headers); r = c.getresponse(); n = 0
    while True:
        b = r.read(1 << 20)
        if not b: break
        n += len(b)
    assert r.status == 200, r.status
    return n
c = connect(); get(c, "/echo")
keep = []
for _ in range(cfg["n"]):
    t = time.perf_counter(); get(c, "/echo"); keep.append((time.perf_counter() - t) * 1000)
new = []
for _ in range(max(5, cfg["n"] // 4)):
    t = time.perf_counter(); d = connect(); get(d, "/echo"); d.close()
    new.append((time.perf_counter() - t) * 1000)
t = time.perf_counter(); got = get(c, "/bytes?n=%d" % cfg["size"]); dt = time.perf_counter() - t
print(json.dumps({"keepalive": keep, "new_conn": new, "mb_s": got / dt / 1e6}))
"""


async def run(quick: bool) -> dict[str, Any]:
    n, size = (40, 64 << 20) if quick else (200, 256 << 20)
    tag = f"spx{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-egress-sb-", dir="/var/tmp"))
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-bench-egress-node-", dir="/var/tmp")).resolve()
    ca = UpstreamCA(workdir)
    upstreams = []
    node = LocalNode(data_dir, network="sandbox", cgroup_parent="space-bench-egress")
    results: dict[str, Any] = {}
    try:
        upstreams.append(
            start_upstream(tag, "api", 51, ca.issue("api.pem", ["api.test"], ["10.98.51.2"]), workdir)
        )
        upstreams.append(
            start_upstream(tag, "spl", 52, ca.issue("spl.pem", ["splice.test"], ["10.98.52.2"]), workdir)
        )
        api, spl = upstreams
        agent = await node.start(progress=lambda line: None)
        credentials = StaticCredentials()
        wiring = await install(agent, EgressSettings(
            state_dir=data_dir / "egress",
            resolver=StaticResolver({"api.test": [api.addr], "splice.test": [spl.addr]}),
            trust_store=ca.ca_file, operator_allowed_networks=[ipaddress.ip_network("10.98.0.0/16")],
            credentials=credentials,
        ))  # fmt: skip
        assert wiring is not None
        placeholder = "space-cred-bench-" + os.urandom(12).hex()
        creates = []
        sandbox_ids = []
        for _ in range(5 if quick else 15):
            sandbox_id = new_sandbox_id()
            wiring.remember(sandbox_id, EgressRequest(allow=["api.test", "splice.test"]))
            credentials.by_sandbox[sandbox_id] = [
                Credential(
                    name="bench", value="bench-secret-value", hosts=["api.test"], placeholder=placeholder
                )
            ]
            started = time.perf_counter()
            await agent.create("python", sandbox_id=sandbox_id, env={"BENCH_TOKEN": placeholder})
            creates.append((time.perf_counter() - started) * 1000)
            sandbox_ids.append(sandbox_id)
        results["create_warm"] = summarize(creates)
        for extra in sandbox_ids[1:]:
            await agent.delete(extra)
        handle = agent.get(sandbox_ids[0])
        await handle.session.write_file(CA_BUNDLE_PATH, ca.ca_file.read_bytes(), append=True)
        proxy = [wiring.sandbox_gateway_addr, wiring.gateway.ports["proxy"]]

        def host_direct(host: str) -> dict[str, Any]:
            cfg = {"host": host, "n": n, "size": size, "cafile": str(ca.ca_file)}
            out = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(cfg)], capture_output=True,
                                 text=True, check=True)  # fmt: skip
            return dict(json.loads(out.stdout))

        async def in_sandbox(host: str, headers: dict[str, str]) -> dict[str, Any]:
            cfg = {"host": host, "n": n, "size": size, "proxy": proxy, "headers": headers}
            r = await handle.session.exec(["python3", "-c", CLIENT, json.dumps(cfg)], timeout=600)
            assert r.exit_code == 0, r.stderr
            return dict(json.loads(r.stdout))

        samples = {
            "host_direct": await asyncio.to_thread(host_direct, api.addr),
            "splice": await in_sandbox("splice.test", {}),
            "intercept": await in_sandbox("api.test", {"Authorization": "Bearer {BENCH_TOKEN}"}),
        }
        for kind in ("keepalive", "new_conn"):
            for path, got in samples.items():
                results[f"https_{path}_{kind}"] = summarize(got[kind])
        for path, got in samples.items():
            results[f"download_{path}"] = {"mb_per_s": round(got["mb_s"], 1), "bytes": size}
        applies = []
        for i in range(50):
            started = time.perf_counter()
            await wiring.apply(
                handle.sandbox_id, EgressRequest(allow=["api.test", f"x{i}.test"], version=i + 1)
            )
            applies.append((time.perf_counter() - started) * 1000)
        results["policy_change_applied"] = summarize(applies)
    finally:
        if node.agent is not None:
            await node.agent.delete_all()
        await node.stop(purge=True)
        for upstream in upstreams:
            upstream.close()
        shutil.rmtree(workdir, ignore_errors=True)
        for parent in pathlib.Path("/sys/fs/cgroup").glob("*/space-bench-egress"):
            with contextlib.suppress(OSError):
                parent.rmdir()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (runsc, network namespaces, nftables)")
    results = asyncio.run(run(args.quick))
    print_table(results, TARGETS)
    path = write_json(results, "egress-sandbox")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
