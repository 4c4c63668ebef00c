"""Cheap cgroup moves on a sandbox host: the kernel's `favordynmods` (ADR 0086; root helper only).

Every runtime start moves processes between cgroups: `runsc run` and `runsc restore` join the container's
cgroups, then put themselves back. The kernel guards every such move with one machine-wide lock, tuned by
default for cheap forks and exits and dear moves: a move after a quiet spell of a few tens of milliseconds
waits for an RCU grace period (6-13 ms measured on the reference machine), and a runtime start pays it
twice. With `favordynmods` on a cgroup2 mount the kernel keeps that lock in the mode where a move costs
about 0.25 ms, at a small cost to every fork and exit on the machine (the kernel's own trade-off, made for
hosts whose cgroups change all the time, as a sandbox host's do).

Invariants:
- Asked for only when the kernel lists `favordynmods` in /sys/kernel/cgroup/features, by remounting a
  cgroup2 mount found in /proc/mounts (the unified hierarchy of a hybrid host, /sys/fs/cgroup of a v2 one)
  with that option added and nothing else changed.
- Best effort: the outcome is reported (node.prepare's answer, the helper's log), never raised; a node
  without it works as before, only slower to start runtimes.
- The mode is global and the kernel keeps it until the machine reboots: turning the setting off later does
  not undo it (a remount without the option may not clear it either).
"""

from __future__ import annotations

import logging
import pathlib
import re
from collections.abc import Callable

from space.core import errors
from space.node.helper import netns

FEATURES = pathlib.Path("/sys/kernel/cgroup/features")
MOUNTS = pathlib.Path("/proc/mounts")
OPTION = "favordynmods"
log = logging.getLogger(__name__)


def _remount(path: str) -> None:
    netns.run(["mount", "-o", f"remount,{OPTION}", path], what=f"remounting {path} with {OPTION}")


def _unescape(field: str) -> str:
    """/proc/mounts writes a space, tab, newline or backslash of a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def favor_dynamic_moves(
    features: pathlib.Path = FEATURES,
    mounts: pathlib.Path = MOUNTS,
    remount: Callable[[str], None] = _remount,
) -> str:
    """ "on" (already, or now), "unsupported" (the kernel has no such mode), "no cgroup2 mount", or
    "failed: REASON"."""
    try:
        if OPTION not in features.read_text().split():
            return "unsupported"
        table = mounts.read_text()
    except OSError:
        return "unsupported"
    target: str | None = None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[2] != "cgroup2":
            continue
        if OPTION in fields[3].split(","):
            return "on"
        target = target or _unescape(fields[1])
    if target is None:
        return "no cgroup2 mount"
    try:
        remount(target)
    except errors.RuntimeFailure as exc:
        log.warning("cgroup moves stay slow: %s", exc.message)
        return f"failed: {exc.message}"
    log.info("cgroup moves favoured (%s on %s)", OPTION, target)
    return "on"
