"""Where the time of a create through the API goes (issue 12, docs/adr/0046-direct-create-path.md).

The control plane runs in this process (the real app on uvicorn, SQLite), against one simulated node
(tests/support/fake_fleet.py: it answers the node RPC in memory, so what is left is the control plane's
own cost). Spans are taken by wrapping, for the time of the run, the store's methods, the node client's
create and the reconciler's poke; `N` sequential `POST /v1/sandboxes` (wait=true) are measured from the
client. Per request: the wall time, and the sum of each span kind inside it; "poke -> claim" is the time
from the request's poke of the reconciler to the reconciler's claim of work.

`--reconciler-only` measures the path before the direct one: the request records the row and waits for
the reconciler's loop (Reconciler.drive is replaced by "not taken"), everything else the same.

Run: `python -m bench.create_path_bench [-n 100] [--reconciler-only]`; prints one JSON document (progress
goes to stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import pathlib
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

import httpx
import uvicorn
from tests.support.cluster import bootstrap, free_port, wait_for
from tests.support.fake_fleet import FakeFleet

from bench.stats import percentile
from space.controlplane.api import deps
from space.controlplane.api import sandboxes as sandbox_routes
from space.controlplane.api.app import create_app
from space.controlplane.reconciler.loop import Reconciler
from space.controlplane.settings import ControlPlaneSettings
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.store import Store
from space.node.rpc_client import NodeClient

STORE_METHODS = (
    "create_sandbox", "claim_work", "hold", "transition", "update_observed", "release", "load_sandbox",
    "get_sandbox", "list_nodes", "list_sandboxes_on_node", "get_node", "record_failure",
)  # fmt: skip
SPANS: list[tuple[str, float, float]] = []  # (kind, start, duration), perf_counter seconds


def _wrap_sync(owner: type, name: str) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPANS.append((f"db.{name}", start, time.perf_counter() - start))

    setattr(owner, name, timed)


def _wrap_async(owner: Any, name: str, kind: str) -> None:
    """Time every call of the coroutine function `owner.name` (a class's method or a module's function)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            SPANS.append((kind, start, time.perf_counter() - start))

    setattr(owner, name, timed)


def instrument() -> None:
    for name in STORE_METHODS:
        _wrap_sync(Store, name)
    _wrap_async(NodeClient, "create_sandbox", "node.create")
    poke = Reconciler.poke

    def timed_poke(self: Reconciler) -> None:
        SPANS.append(("poke", time.perf_counter(), 0.0))
        poke(self)

    Reconciler.poke = timed_poke  # type: ignore[method-assign]
    # Module globals the create route looks up at call time: the whole route, the caller's authentication.
    _wrap_async(sandbox_routes, "_create", "route.create")
    _wrap_async(deps, "authenticate_key", "auth")


def reconciler_only() -> None:
    """The path before the direct one: the request never takes the lease, the loop does the work."""

    async def not_taken(self: Reconciler, record: Any) -> None:
        return None

    Reconciler.drive = not_taken  # type: ignore[method-assign]


def serve(app: Any, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    return server, thread


def breakdown(requests: list[tuple[float, float]]) -> dict[str, Any]:
    """Per span kind: the median over requests of its summed time inside each request, and its count."""
    per_kind: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[int]] = defaultdict(list)
    poke_to_claim: list[float] = []
    kinds = sorted({kind for kind, _s, _d in SPANS})
    for start, end in requests:
        inside = [(k, s, d) for k, s, d in SPANS if start <= s and s + d <= end]
        for kind in kinds:
            mine = [d for k, _s, d in inside if k == kind]
            per_kind[kind].append(sum(mine) * 1000)
            counts[kind].append(len(mine))
        pokes = [s for k, s, _d in inside if k == "poke"]
        claims = [s for k, s, _d in inside if k == "db.claim_work" and pokes and s >= pokes[0]]
        if pokes and claims:
            poke_to_claim.append((claims[0] - pokes[0]) * 1000)
    result: dict[str, Any] = {
        kind: {"p50_ms": round(percentile(per_kind[kind], 50), 2), "calls_p50": percentile(counts[kind], 50)}
        for kind in kinds
        if any(counts[kind])
    }
    if poke_to_claim:
        result["poke_to_claim"] = {"p50_ms": round(percentile(poke_to_claim, 50), 2)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--reconciler-only", action="store_true")
    args = parser.parse_args(argv)
    instrument()
    if args.reconciler_only:
        reconciler_only()
    with tempfile.TemporaryDirectory(prefix="space-create-bench-") as tmp:
        url = sqlite_url(pathlib.Path(tmp) / "cp")
        store, _org, _project, admin_key = bootstrap(url)
        token = "bench-bootstrap-token-0123456789abcdef"
        settings = ControlPlaneSettings.from_env()
        port = free_port()
        app = create_app(Store(url), node_token=token, settings=settings)
        server, thread = serve(app, port)
        base = f"http://127.0.0.1:{port}"
        fleet = FakeFleet([base], token, 1, heartbeat_s=0.5)
        try:
            wait_for(lambda: httpx.get(f"{base}/healthz").status_code == 200, timeout=30, what="healthy")
            fleet.start()
            wait_for(lambda: store.list_nodes("ready"), timeout=30, what="node registered")
            samples, windows = [], []
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin_key}"}) as http:
                for i in range(args.n):
                    start = time.perf_counter()
                    answer = http.post("/v1/sandboxes", json={"template": "python"})
                    end = time.perf_counter()
                    answer.raise_for_status()
                    samples.append((end - start) * 1000)
                    windows.append((start, end))
                    if i % 20 == 0:
                        print(f"{i}/{args.n}", file=sys.stderr)
            report = {
                "path": "reconciler" if args.reconciler_only else "direct",
                "create_api": {
                    "p50_ms": round(percentile(samples, 50), 2),
                    "p90_ms": round(percentile(samples, 90), 2),
                    "max_ms": round(max(samples), 2),
                    "n": len(samples),
                },
                "spans": breakdown(windows),
            }
            print(json.dumps(report, indent=2))
        finally:
            fleet.close()
            server.should_exit = True
            thread.join(10)
            store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
