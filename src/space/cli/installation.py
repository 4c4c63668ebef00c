"""The local installation `space up` runs from a data directory: where its files are, whether its
supervisor is alive, and stopping components a dead supervisor left behind.

Invariants:
- `DATA_DIR/up.json` exists exactly while a supervisor runs (or one died without removing it: its pid is
  then dead, and `supervisor_pid` says so).
- A process is only ever signalled as a leftover when the status file names its pid AND its command line
  names this data directory: a reused pid of someone else's process is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import time
from typing import Any

from space.controlplane.supervisor import read_status

DEFAULT_DATA_DIR = pathlib.Path("/var/lib/space")
LEFTOVER_STOP_S = 20.0


def state_file(data_dir: pathlib.Path) -> pathlib.Path:
    return data_dir / "up.json"


def read_state(data_dir: pathlib.Path) -> dict[str, object] | None:
    try:
        value = json.loads(state_file(data_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def supervisor_pid(data_dir: pathlib.Path) -> int | None:
    """The pid of the live supervisor of `data_dir`, or None."""
    state = read_state(data_dir)
    pid = int(str(state.get("pid", 0))) if state else 0
    return pid if alive(pid) else None


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _ours(pid: int, data_dir: pathlib.Path) -> bool:
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.fsencode(str(data_dir)) in argv


def rows_of(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The component rows of a status file's content (whatever in it is not a row is ignored)."""
    rows = status.get("components")
    return [row for row in rows if isinstance(row, dict) and "name" in row] if isinstance(rows, list) else []


def stop_leftovers(data_dir: pathlib.Path) -> list[int]:
    """SIGTERM (then SIGKILL) the components a dead supervisor left running; returns their pids. The agent
    and the control plane go before the helper, as in an orderly stop."""
    rows = rows_of(read_status(data_dir) or {})
    order = {"controlplane": 0, "agent": 1, "helper": 2}
    rows.sort(key=lambda row: order.get(str(row.get("name")), 3))
    stopped = []
    for row in rows:
        pid = row.get("pid")
        if not isinstance(pid, int) or not alive(pid) or not _ours(pid, data_dir):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + LEFTOVER_STOP_S
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stopped.append(pid)
    return stopped
