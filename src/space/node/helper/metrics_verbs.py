"""The helper verb behind the agent's metrics history (docs/adr/0053-sandbox-metrics-history.md): one read
of the CPU, memory and disk counters of many sandboxes, in one call per sampling tick.

Invariants:
- Read-only: the verb reads cgroup files and btrfs accounting, never writes a cgroup or starts a process
  (no fork/exec: the qgroup numbers are ioctls, the cgroup numbers plain file reads).
- Its argument is a list of validated sandbox ids (space.node.helper.params' id pattern), at most
  MAX_SANDBOXES of them; every path comes from NodeLayout and the helper's own record of each sandbox's
  container, never from the request.
- A sandbox whose counters cannot be read (not running, no container, a cgroup gone between two reads)
  is answered with None in those fields, never an error: one vanished sandbox must not cost the others
  their sample.
- The disk number is the storage accounting of ADR 0027 without a commit (`sync=False`): as current as the
  filesystem's last commit, so a tick never forces one.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Annotated, Any

from pydantic import Field

from space.core import errors
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import Params, SandboxId, StorageParams
from space.node.helper.storage import sandbox_storage

#: The most sandboxes one call reads (the agent splits a larger node into several calls).
MAX_SANDBOXES = 256
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


class MetricsParams(Params):
    sandbox_ids: Annotated[list[SandboxId], Field(min_length=1, max_length=MAX_SANDBOXES)]


def _read_int(path: pathlib.Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


def _stat_value(path: pathlib.Path, *keys: str) -> int | None:
    """The first of `keys` found in a cgroup file of `key value` lines (None if unreadable or absent)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    values = dict(line.partition(" ")[::2] for line in lines)
    for key in keys:
        value = values.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return None


def cgroup_counters(cgroup: str, root: pathlib.Path = CGROUP_ROOT) -> dict[str, int | None]:
    """CPU time (ns, cumulative), memory charged and page cache (bytes) of `cgroup` (relative, e.g.
    "space/sb-…-0"), from cgroup v1 controllers or the v2 unified tree, whichever holds it."""
    v1_memory = root / "memory" / cgroup
    if v1_memory.is_dir():
        return {
            "cpu_ns": _read_int(root / "cpuacct" / cgroup / "cpuacct.usage"),
            "memory_bytes": _read_int(v1_memory / "memory.usage_in_bytes"),
            "memory_cache_bytes": _stat_value(v1_memory / "memory.stat", "total_cache", "cache"),
        }
    unified = root / cgroup
    usec = _stat_value(unified / "cpu.stat", "usage_usec")
    return {
        "cpu_ns": usec * 1000 if usec is not None else None,
        "memory_bytes": _read_int(unified / "memory.current"),
        "memory_cache_bytes": _stat_value(unified / "memory.stat", "file"),
    }


def _disk_bytes(ctx: HelperContext, sandbox_id: str, progress: Progress) -> int | None:
    try:
        storage = sandbox_storage(ctx, StorageParams(sandbox_id=sandbox_id, sync=False), progress)
    except (errors.SpaceError, OSError):
        return None
    files = storage.get("files_bytes")
    return int(storage["used_bytes"]) if files is not None else None


def sandbox_metrics(ctx: HelperContext, params: MetricsParams, progress: Progress) -> dict[str, Any]:
    """{"sandboxes": [{"sandbox_id", "source" (the cgroup: a new one per runtime), "cpu_ns", "memory_bytes",
    "memory_cache_bytes", "disk_bytes"}]}, one entry per requested id, in the order asked."""
    answers: list[dict[str, Any]] = []
    for sandbox_id in params.sandbox_ids:
        cgroup = ctx.runtimes.cgroup_name(sandbox_id)
        counters: dict[str, int | None] = (
            cgroup_counters(cgroup)
            if cgroup is not None
            else {"cpu_ns": None, "memory_bytes": None, "memory_cache_bytes": None}
        )
        disk = _disk_bytes(ctx, sandbox_id, progress)
        answers.append({"sandbox_id": sandbox_id, "source": cgroup, **counters, "disk_bytes": disk})
    return {"sandboxes": answers}
