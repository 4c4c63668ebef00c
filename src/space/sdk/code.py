"""What `run_code` answers: the events of one execution in the sandbox's Jupyter kernel (ADR 0058), gathered.

Invariants:
- Built only from the API's NDJSON events (`POST /v1/sandboxes/{id}/code`: E2B's shapes, but the code's
  exception is `exception`), in the order they came; unknown event types are ignored (a newer server may
  add some).
- `results` keep every format the kernel gave (text, html, png as base64, ...); `text` is the main
  result's text (the cell's last expression), like E2B's `Execution.text`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CodeError:
    name: str
    value: str
    traceback: str


@dataclass
class CodeExecution:
    """The outcome of one run_code: its results, its output, its error (None if it raised nothing)."""

    results: list[dict[str, Any]] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    error: CodeError | None = None
    execution_count: int | None = None
    timed_out: bool = False
    finished: bool = False

    @property
    def text(self) -> str | None:
        for result in self.results:
            if result.get("is_main_result"):
                text = result.get("text")
                return text if isinstance(text, str) else None
        return None

    def take(self, event: dict[str, Any]) -> None:
        """Add one event of the stream."""
        kind = event.get("type")
        if kind == "result":
            self.results.append({k: v for k, v in event.items() if k != "type"})
        elif kind in ("stdout", "stderr"):
            (self.stdout if kind == "stdout" else self.stderr).append(str(event.get("text", "")))
        elif kind == "exception":
            self.error = CodeError(
                str(event.get("name", "")), str(event.get("value", "")), str(event.get("traceback", ""))
            )
        elif kind == "number_of_executions":
            count = event.get("execution_count")
            self.execution_count = count if isinstance(count, int) else None
        elif kind == "timeout":
            self.timed_out = True
        elif kind == "end_of_execution":
            self.finished = True
