"""The metrics history across agent restarts (docs/adr/0053-sandbox-metrics-history.md): the rings of
space.node.agent.metrics saved to one file of the agent's private state directory, read back once when the
sampler starts.

Invariants:
- The file is replaced atomically (0600, the agent's own directory): a reader sees a whole history or the
  one before it, never half; a file that is missing, too large or not what this module writes is ignored
  (logged), never an error: the history then starts afresh, as it did before this file existed.
- Each sandbox's history is saved with the incarnation of the copy it describes (space.node.agent.
  incarnations), and is taken back only by a copy of the same incarnation, so the history of a copy that
  was restored elsewhere meanwhile never passes to the copy adopted here.
- Samples travel as the ring's own float columns (native doubles, base64), row by row: no value is
  rounded by the round trip.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import pathlib
from array import array
from dataclasses import dataclass
from typing import Any

from space.node import filemodes

log = logging.getLogger("space.node.agent.metrics")

FORMAT = 1
#: A history file larger than this is not read (8192 samples x 5 columns x 8 bytes is 320 KiB a sandbox).
MAX_FILE_BYTES = 256 << 20


@dataclass(frozen=True)
class SavedHistory:
    incarnation: int | None
    rows: list[tuple[float, ...]]


def save(path: pathlib.Path, histories: dict[str, SavedHistory], columns: int) -> None:
    """Write every history to `path` (atomically; OSError if it cannot be written)."""
    sandboxes: dict[str, Any] = {}
    for sandbox_id, history in histories.items():
        flat = array("d", [value for row in history.rows for value in row])
        sandboxes[sandbox_id] = {
            "incarnation": history.incarnation,
            "samples": base64.b64encode(flat.tobytes()).decode(),
        }
    body = {"format": FORMAT, "columns": columns, "sandboxes": sandboxes}
    filemodes.replace_private_file(path, json.dumps(body).encode(), durable=False)


def load(path: pathlib.Path, columns: int) -> dict[str, SavedHistory]:
    """The histories `path` holds ({} when none can be read)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            log.warning("metrics history %s is larger than %d bytes: not read", path, MAX_FILE_BYTES)
            return {}
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("metrics history %s unreadable (%s): starting afresh", path, exc)
        return {}
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("columns") != columns:
        log.warning("metrics history %s is not in this agent's format: starting afresh", path)
        return {}
    found: dict[str, SavedHistory] = {}
    for sandbox_id, entry in dict(body.get("sandboxes") or {}).items():
        history = _history(entry, columns)
        if history is not None:
            found[str(sandbox_id)] = history
    return found


def _history(entry: Any, columns: int) -> SavedHistory | None:
    if not isinstance(entry, dict):
        return None
    incarnation = entry.get("incarnation")
    if incarnation is not None and (not isinstance(incarnation, int) or isinstance(incarnation, bool)):
        return None
    try:
        raw = base64.b64decode(str(entry.get("samples", "")), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) % (8 * columns):
        return None
    flat = array("d")
    flat.frombytes(raw)
    rows = [tuple(flat[i : i + columns]) for i in range(0, len(flat), columns)]
    return SavedHistory(incarnation, rows)
