"""What the MCP tools answer, as short text an agent reads: one line per sandbox, snapshot or file, a
command's exit and bounded output, an error's code, message and state. No I/O here.

Invariants:
- Every answer is bounded: output longer than OUTPUT_CHARS keeps its head and its tail (where errors
  usually are) around a note saying how much was cut; a listing shows at most LIST_LINES lines and says
  how many it left out.
- An error's text names its code and message, plus the state for a request the lifecycle refuses, and
  never more than the SDK's typed error carries (no traceback, no server internals).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from space.core.errors import InvalidState, SpaceError
from space.sdk.models import ExecResult

__all__ = [
    "LIST_LINES",
    "OUTPUT_CHARS",
    "bounded",
    "error_text",
    "exec_text",
    "file_lines",
    "sandbox_line",
    "sandbox_lines",
    "size_text",
    "snapshot_line",
]

#: Characters of one output stream (stdout or stderr) a tool answer keeps.
OUTPUT_CHARS = 16_000
#: Of those, the first HEAD_CHARS; the rest come from the end.
HEAD_CHARS = 4_000
#: Lines of a listing (sandboxes, snapshots, files).
LIST_LINES = 200


def size_text(size: int) -> str:
    """1536 -> "1.5 KiB"."""
    value = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def bounded(text: str, limit: int = OUTPUT_CHARS, head: int = HEAD_CHARS) -> str:
    """`text`, or its first `head` and last `limit - head` characters around a note of what was cut."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    note = (
        f"\n[... {cut} characters cut here: the answer keeps the first {head} and the last"
        f" {limit - head}; redirect the output to a file and read it in parts ...]\n"
    )
    return text[:head] + note + text[len(text) - (limit - head) :]


def error_text(error: SpaceError) -> str:
    """`<code>: <message>`, with the sandbox's state when the lifecycle refused the request."""
    text = f"{error.code}: {error.message}"
    if isinstance(error, InvalidState) and error.state and f"'{error.state}'" not in error.message:
        text += f" (the sandbox is {error.state})"
    return text


def sandbox_line(data: Mapping[str, Any]) -> str:
    """`<id>  <state>  template=<name>` and what else an agent needs to know about it."""
    parts = [str(data.get("id", "?")), str(data.get("state", "unknown")), f"template={data.get('template')}"]
    if data.get("isolation") == "microvm":  # gVisor, the default, goes without saying
        parts.append("isolation=microvm")
    metadata = data.get("metadata")
    if isinstance(metadata, Mapping) and metadata:
        parts.append("metadata=" + ",".join(f"{k}={v}" for k, v in sorted(metadata.items())))
    if data.get("expires_at"):
        parts.append(f"expires {data['expires_at']}")
    if data.get("forked_from"):
        parts.append(f"forked from {data['forked_from']}")
    if data.get("error"):
        parts.append(f"error: {data['error']}")
    return "  ".join(parts)


def sandbox_lines(records: Iterable[Mapping[str, Any]]) -> str:
    lines = [sandbox_line(data) for data in records]
    if not lines:
        return "No sandboxes."
    return _listing(f"{len(lines)} sandbox(es):", lines)


def snapshot_line(data: Mapping[str, Any]) -> str:
    parts = [str(data.get("id", "?")), str(data.get("kind", "?")), str(data.get("state", "?"))]
    if data.get("created_at"):
        parts.append(f"taken {data['created_at']}")
    return "  ".join(parts)


def file_lines(path: str, entries: Iterable[Mapping[str, Any]], *, truncated: bool = False) -> str:
    """One line per entry: type, size, name (a directory's name ends in /, a link's shows its target);
    `truncated`: the server's listing stopped at its limit (said in the last line)."""
    lines = []
    for entry in sorted(entries, key=lambda e: str(e.get("name", ""))):
        kind = str(entry.get("type", "?"))
        name = str(entry.get("name", "?")) + ("/" if kind in {"dir", "directory"} else "")
        target = entry.get("target") or entry.get("symlink_target")
        if target:
            name += f" -> {target}"
        lines.append(f"{kind:<8}{entry.get('size', 0):>12}  {name}")
    if not lines:
        return f"{path} is empty."
    text = _listing(f"{path}: {len(lines)} entries (type, size in bytes, name)", lines)
    if truncated:
        text += f"\n... and more: a listing shows at most {LIST_LINES} entries (list a subdirectory)"
    return text


def exec_text(result: ExecResult) -> str:
    """How the command ended, then its stdout and stderr (each bounded; an empty stream is left out)."""
    if result.timed_out:
        status = "timed out (killed)"
    elif result.exit_code is None:
        status = f"killed by signal {result.signal}" if result.signal is not None else "no exit code"
    else:
        status = f"exit code {result.exit_code}"
    parts = [status]
    for name, text, truncated in (
        ("stdout", result.stdout, result.stdout_truncated),
        ("stderr", result.stderr, result.stderr_truncated),
    ):
        if text:
            cut = " (the server kept only its first part)" if truncated else ""
            parts.append(f"--- {name}{cut} ---\n{bounded(text)}")
    if len(parts) == 1:
        parts.append("(no output)")
    return "\n".join(parts)


def _listing(header: str, lines: list[str]) -> str:
    shown = lines[:LIST_LINES]
    if len(lines) > LIST_LINES:
        shown.append(f"... and {len(lines) - LIST_LINES} more")
    return "\n".join([header, *shown])
