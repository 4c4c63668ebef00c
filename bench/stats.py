"""Percentiles and the result table shared by the benchmarks."""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(samples_ms: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "p50_ms": round(percentile(samples_ms, 50), 2),
        "p90_ms": round(percentile(samples_ms, 90), 2),
        "p99_ms": round(percentile(samples_ms, 99), 2),
        "max_ms": round(max(samples_ms), 2),
        "n": len(samples_ms),
        **extra,
    }


def print_table(results: dict[str, dict[str, Any]], targets: dict[str, str]) -> None:
    print(f"{'operation':<26} {'p50':>10} {'p90':>10} {'p99':>10} {'n':>5}  other / target")
    for name, row in results.items():
        if "p90_ms" in row:
            other = ", ".join(
                f"{k}={v}" for k, v in row.items() if k not in {"p50_ms", "p90_ms", "p99_ms", "max_ms", "n"}
            )
            print(
                f"{name:<26} {row['p50_ms']:>8.2f}ms {row['p90_ms']:>8.2f}ms {row['p99_ms']:>8.2f}ms "
                f"{row['n']:>5}  {other} [{targets.get(name, '')}]"
            )
        else:
            other = ", ".join(f"{k}={v}" for k, v in row.items())
            print(f"{name:<26} {'':>32} {'':>5}  {other} [{targets.get(name, '')}]")


RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def write_json(results: dict[str, Any], kind: str, out_dir: pathlib.Path = RESULTS_DIR) -> pathlib.Path:
    """Write `<kind>-<time>.json` and `<kind>-latest.json` under `out_dir`; the first one's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    (out_dir / f"{kind}-latest.json").write_text(json.dumps(results, indent=2))
    return path
