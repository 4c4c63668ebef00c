"""What the E2B front adds to a request: the same operations through E2B's SDK (E2B's control API) and
through SPACE's SDK (SPACE's API), against one fake-driver cluster whose control plane serves both
(docs/adr/0052-e2b-control-front.md). The fake driver keeps node work small, so the difference is the
front's own cost (translation, its own lookups) plus the two SDKs'.

    .venv/bin/python -m bench.e2b_front_bench [--creates N] [--reads N]

Prints JSON: p50/p90 in milliseconds of create (wait until running), get and list, per path; progress on
stderr. Runs interleaved (E2B, SPACE, E2B, ...) so load changes hit both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable

import e2b
from tests.support import cluster as c

from bench.stats import percentile


def _timed(samples: list[float], call: Callable[[], object]) -> object:
    started = time.perf_counter()
    result = call()
    samples.append((time.perf_counter() - started) * 1000)
    return result


def _summary(samples: list[float]) -> dict[str, float]:
    p50, p90 = percentile(samples, 50), percentile(samples, 90)
    return {"n": len(samples), "p50_ms": round(p50, 2), "p90_ms": round(p90, 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=30)
    parser.add_argument("--reads", type=int, default=200)
    args = parser.parse_args()
    api_port, sandbox_port = c.free_port(), c.free_port()
    listen = ("--e2b-api-listen", f"127.0.0.1:{api_port}")
    listen += ("--e2b-sandbox-listen", f"127.0.0.1:{sandbox_port}")
    root = pathlib.Path(tempfile.mkdtemp(prefix="space-e2b-bench-"))
    times: dict[str, list[float]] = {}

    def timed(name: str, call: Callable[[], object]) -> object:
        return _timed(times.setdefault(name, []), call)

    with c.start_fake_cluster(root, control_plane_args=listen) as cluster:
        project = c.new_project(cluster)
        os.environ["E2B_API_KEY"] = project.key
        os.environ["E2B_API_URL"] = f"http://127.0.0.1:{api_port}"
        os.environ["E2B_SANDBOX_URL"] = f"http://127.0.0.1:{sandbox_port}"
        os.environ["E2B_DOMAIN"] = "space.invalid"
        space = project.sdk()
        first_e2b = first_space = None
        for i in range(args.creates):
            made_e2b = timed("create e2b", lambda: e2b.Sandbox.create(timeout=3600))
            made_space = timed("create space", space.sandboxes.create)
            if first_e2b is None:
                first_e2b, first_space = made_e2b, made_space  # kept for the reads
            else:  # the others go at once: a fake node has room for a few sandboxes only
                made_e2b.kill()  # type: ignore[attr-defined]
                made_space.delete()  # type: ignore[attr-defined]
            print(f"create {i + 1}/{args.creates}", file=sys.stderr)
        for _ in range(args.reads):
            timed("get e2b", first_e2b.get_info)  # type: ignore[union-attr]
            timed("get space", lambda: space.sandboxes.get(first_space.id))  # type: ignore[union-attr]
        for _ in range(args.reads // 4):
            timed("list e2b", lambda: e2b.Sandbox.list(limit=100).next_items())
            timed("list space", space.sandboxes.list)
        c.delete_all(cluster, project)
    load = os.getloadavg()[0]
    print(json.dumps({"load_avg_1m": round(load, 1), **{k: _summary(v) for k, v in times.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
