"""What `space bench` reports: the JSON document, its `meta`, the table with the targets, and the chart.

Invariants:
- The JSON holds numbers only (targets are printed beside the table, never stored); one object per
  operation with p50_ms, p90_ms, p99_ms, max_ms and n (and `spans`, its median span breakdown: span name
  -> ms, when the control plane keeps traces; ADR 0072), plus `ratios` and `meta`.
- `meta.target` never carries a secret: the URL loses any user info, query and fragment.
- The chart is optional: without matplotlib it is skipped with a note on stderr, never a failure.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess
import sys
import urllib.parse
from typing import Any, TextIO

from bench.api_spans import format_breakdown
from bench.stats import summarize

#: The operations of issue 12, in the order they are reported.
OPERATIONS = (
    "create_warm", "create_warm_c8", "create_cold", "create_plain_runsc", "exec_true", "exec_true_node",
    "file_4k", "pause", "resume", "snapshot_disk", "checkpoint_full", "fork", "suspend", "restore",
)  # fmt: skip
#: The targets of issue 12 (printed beside the table; the JSON has the numbers only).
TARGETS = {
    "create_warm": "p50 <= 25 ms, p90 <= 40 ms (request to first exec answered)",
    "create_warm_c8": "p90 <= 120 ms at concurrency 8",
    "create_cold": "(SPACE without a pool: the fallback path)",
    "create_plain_runsc": "(baseline: plain runsc run of a fresh rootfs copy)",
    "exec_true": "p50 <= 13 ms",
    "exec_true_node": "(reference: the node-level call)",
    "ratios.create_warm_vs_plain_runsc": "<= 0.1",
    "ratios.create_warm_vs_cold": "(lower is better)",
    "ratios.exec_api_vs_node": "(hop <= 2 ms p50 over the node)",
}
#: Each ratio of p50s: (numerator operation, denominator operation).
RATIOS = {
    "create_warm_vs_plain_runsc": ("create_warm", "create_plain_runsc"),
    "create_warm_vs_cold": ("create_warm", "create_cold"),
    "exec_api_vs_node": ("exec_true", "exec_true_node"),
}


def public_url(url: str) -> str:
    """`url` without user info, query or fragment (what may be written to a result file)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def git_commit(directory: pathlib.Path) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    commit = proc.stdout.strip()
    return commit if proc.returncode == 0 and commit else None


def meta(
    *, target: str, embedded: bool, quick: bool, samples: int | None, load_at_start: float | None = None
) -> dict[str, Any]:
    """What the numbers were measured on (the load average at the start and at the end of the run: a loaded
    machine's numbers are upper bounds)."""
    return {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "load_avg_1m_start": load_at_start,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "git_commit": git_commit(pathlib.Path(__file__).resolve().parent),
        "quick": quick,
        "samples_override": samples,
        "embedded": embedded,
        "target": public_url(target),
    }


def document(
    samples: dict[str, list[float]], extras: dict[str, dict[str, Any]], run_meta: dict[str, Any]
) -> dict[str, Any]:
    """The JSON document: each measured operation summarized, the ratios of p50s, and `meta`."""
    doc: dict[str, Any] = {}
    for name in OPERATIONS:
        if samples.get(name):
            doc[name] = summarize(samples[name], **extras.get(name, {}))
    ratios = {}
    for ratio, (top, bottom) in RATIOS.items():
        if top in doc and bottom in doc and doc[bottom]["p50_ms"] > 0:
            ratios[ratio] = round(doc[top]["p50_ms"] / doc[bottom]["p50_ms"], 3)
    doc["ratios"] = ratios
    doc["meta"] = run_meta
    return doc


def print_table(doc: dict[str, Any], out: TextIO) -> None:
    """Aligned rows (one per operation, then the ratios), each with its target from the issue."""
    print(f"{'operation':<20} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9} {'n':>5}  from / target", file=out)
    for name in OPERATIONS:
        row = doc.get(name)
        if row is None:
            continue
        origin = ", ".join(f"{k}={v}" for k, v in row.get("from", {}).items())
        note = "  ".join(part for part in (origin, TARGETS.get(name, "")) if part)
        cells = " ".join(f"{row[key]:>7.1f}ms" for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms"))
        print(f"{name:<20} {cells} {row['n']:>5}  {note}", file=out)
    for ratio, value in doc["ratios"].items():
        print(f"{'ratio ' + ratio:<60} {value:>7.3f}  {TARGETS.get('ratios.' + ratio, '')}", file=out)
    explained = [name for name in OPERATIONS if doc.get(name, {}).get("spans")]
    if explained:
        print("\nwhere the milliseconds go (median ms per span name; spans nest, ADR 0072):", file=out)
    for name in explained:
        print(f"{name:<20} {format_breakdown(doc[name]['spans'])}", file=out)


def write_chart(samples: dict[str, list[float]], path: pathlib.Path, title: str) -> pathlib.Path | None:
    """A PNG of the latency distributions (one box per operation, log scale); None without matplotlib."""
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install '.[bench]'): no chart written", file=sys.stderr)
        return None
    names = [name for name in OPERATIONS if samples.get(name)]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(names) + 1.8))
    ax.boxplot([samples[n] for n in names], vert=False, whis=(1, 99), showfliers=True, widths=0.6)
    ax.set_yticks(range(1, len(names) + 1), [f"{n} (n={len(samples[n])})" for n in names])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale; box: p25-p75, whiskers: p1-p99)")
    ax.set_title(title)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
