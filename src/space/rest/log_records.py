"""How every SPACE process writes its log lines: plain text (the default, for a terminal and `space up`'s
files) or one JSON object per line (the default of the systemd services, read by `space logs` and log
shippers). Pure formatting: the process entry points install the handler (`configure`) with the format
they read from SPACE_LOG_FORMAT.

A JSON line has exactly these keys: ts (UTC, ISO 8601 with milliseconds), level, component (controlplane,
agent, gateway, helper), logger, msg, request_id and sandbox_id (null when not known; from
space.core.request_ids), trace_id and span_id (the active sampled span's, 32 and 16 hex digits, null
outside one: space.core.tracing, ADR 0079), error (the formatted exception, or null). A text line names the
same ids where known, the trace by its first TEXT_TRACE_CHARS hex digits (`trace=…`: enough to grep).

Invariants:
- One record is one line in either format: a message or traceback with newlines is escaped by JSON, and in
  text the newlines of a traceback stay (as Python's logging writes them) but a request id cannot add any
  (it is a validated token).
- The trace ids are the ones a record was given (`TRACE_IDS_ATTR`: a line written after its span ended,
  as the access line of a request is) or else those of the span active where it was logged; they are
  the ids of SPACE's own spans (a caller's `traceparent` is continued, so its trace id is the caller's),
  made of hex digits only, so they cannot add anything to a line.
- The component of a record logged under `space.node.egress` is `gateway` (the egress gateway runs inside
  the agent's process), so its lines can be told from the agent's.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Literal, TextIO

from space.core import errors, process_env, tracing
from space.core.request_ids import current_request_id, current_sandbox_id

LOG_FORMAT_ENV = process_env.LOG_FORMAT_ENV
LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
COMPONENTS = ("controlplane", "agent", "gateway", "helper", "supervisor")
#: Loggers whose records belong to another component than their process's.
_COMPONENT_BY_LOGGER = (("space.node.egress", "gateway"),)
#: A message longer than this is cut (a log line is not a place for a whole request body).
MAX_MESSAGE = 16_384
#: The record attribute (`extra=`) that names the (trace id, span id) of a line written outside its span.
TRACE_IDS_ATTR = "space_trace_ids"
TEXT_TRACE_CHARS = 16


def trace_ids_of(record: logging.LogRecord) -> tuple[str, str] | None:
    """(trace id, span id) of a record: the ones it was given, else the active span's (None: neither)."""
    given = getattr(record, TRACE_IDS_ATTR, None)
    if isinstance(given, tuple) and len(given) == 2:
        return given
    return tracing.current_ids()


def parse_format(value: str | None) -> LogFormat:
    """SPACE_LOG_FORMAT's value: empty means text; anything else but text or json is an error."""
    if not value:
        return "text"
    if value == "json":
        return "json"
    if value == "text":
        return "text"
    raise errors.InvalidArgument(
        f"{LOG_FORMAT_ENV} is text or json, not {value[:40]!r}", field=LOG_FORMAT_ENV
    )


def component_of(record: logging.LogRecord, default: str) -> str:
    for prefix, component in _COMPONENT_BY_LOGGER:
        if record.name == prefix or record.name.startswith(prefix + "."):
            return component
    return default


class JsonFormatter(logging.Formatter):
    """One JSON object per record (the keys of the module docstring)."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        error = None
        if record.exc_info:
            error = self.formatException(record.exc_info)
        elif record.exc_text:
            error = record.exc_text
        trace_id, span_id = trace_ids_of(record) or (None, None)
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "component": component_of(record, self.component),
            "logger": record.name,
            "msg": record.getMessage()[:MAX_MESSAGE],
            "request_id": current_request_id.get(),
            "sandbox_id": current_sandbox_id.get(),
            "trace_id": trace_id,
            "span_id": span_id,
            "error": error,
        }
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`TIME COMPONENT LEVEL LOGGER: MESSAGE [request_id=… sandbox_id=… trace=…]`: the ids only where
    known (the trace id shortened to TEXT_TRACE_CHARS)."""

    def __init__(self, component: str) -> None:
        super().__init__("%(asctime)s %(component)s %(levelname)s %(name)s: %(message)s")
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        record.component = component_of(record, self.component)
        text = super().format(record)
        ids = [
            (k, v.get()) for k, v in (("request_id", current_request_id), ("sandbox_id", current_sandbox_id))
        ]
        traced = trace_ids_of(record)
        if traced is not None:
            ids.append(("trace", traced[0][:TEXT_TRACE_CHARS]))
        known = " ".join(f"{k}={v}" for k, v in ids if v)
        if not known:
            return text
        first, newline, rest = text.partition("\n")  # the ids go on the message's line, not the traceback's
        return f"{first} [{known}]{newline}{rest}"


def formatter(component: str, log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter(component) if log_format == "json" else TextFormatter(component)


def configure(component: str, *, level: str | int = "INFO", log_format: LogFormat, stream: TextIO) -> None:
    """Make the root logger write `component`'s records to `stream` in `log_format` (replacing whatever
    handlers it had: a process configures its logging once, at start)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(component, log_format))
    logging.basicConfig(
        level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=True
    )
