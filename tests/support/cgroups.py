"""Reading a real sandbox's host cgroups (cgroup v1 here: /sys/fs/cgroup/<controller>/space/<container>),
for tests of resource limits: the newest incarnation's directory, a file in it, and `key value` files."""

from __future__ import annotations

import pathlib

CGROUPS = pathlib.Path("/sys/fs/cgroup")


def cgroup_dir(controller: str, sandbox_id: str) -> pathlib.Path | None:
    """The sandbox's current cgroup `/space/<sandbox id>-<generation>` (the newest incarnation)."""
    base = CGROUPS / controller / "space"
    found = [p for p in base.glob(f"{sandbox_id}-*") if p.name.rsplit("-", 1)[1].isdigit()]
    return max(found, key=lambda p: int(p.name.rsplit("-", 1)[1])) if found else None


def read_cgroup(controller: str, sandbox_id: str, name: str) -> str | None:
    group = cgroup_dir(controller, sandbox_id)
    try:
        return (group / name).read_text() if group is not None else None
    except OSError:
        return None


def cgroup_kv(text: str | None) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values
