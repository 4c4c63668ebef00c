"""OpenTelemetry traces of every operation, kept in a bounded in-memory ring per process (ADR 0072).

Every SPACE process (control plane, node agent, root helper) calls `configure()` once; the layers then open
spans with `Layer.span(name, **attributes)` at their call sites. Spans are always kept in this process's
`RING` (the last `max_traces` traces, each at most `max_spans` spans), and also exported over OTLP when an
endpoint is configured and the optional exporter is installed (`pip install space-sandbox[otlp]`).

Invariants:
- A span carries only the attributes of `ALLOWED_ATTRIBUTES`, each a bool, a number or a string cut to
  MAX_VALUE characters; anything else is dropped, also from spans made by code outside SPACE and from
  records another process sends (`record_from_wire`). So no span carries a credential, an env value, a
  command line or file contents: the names and attributes come from fixed call sites, never from a body.
- Incoming trace context is a W3C `traceparent` header value, parsed by `context_of` and ignored (a new
  root) when it is malformed, all-zero or longer than MAX_TRACEPARENT: a hostile header is never an error.
- With tracing disabled (`SPACE_TRACING=off`) `Layer.span` is a shared no-op context manager and nothing
  is propagated; with `SPACE_TRACE_SAMPLE` < 1, a root trace is kept with that probability and every hop
  follows its parent's decision (the sampled flag of the traceparent).
- The ring's memory is bounded by max_traces * max_spans records; the oldest trace leaves first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

TRACEPARENT = "traceparent"
MAX_TRACEPARENT = 128
MAX_VALUE = 128
MAX_NAME = 128
#: The only attribute keys a span may carry (see the module invariants).
ALLOWED_ATTRIBUTES = frozenset(
    {
        "sandbox_id", "node_id", "route", "status", "method", "verb", "command", "op", "step", "state",
        "what", "error", "guest_method", "template",
    }
)  # fmt: skip
P = ParamSpec("P")
R = TypeVar("R")
_TRACEPARENT_RE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACE_ID_RE = re.compile(r"[0-9a-f]{32}")
_SPAN_ID_RE = re.compile(r"[0-9a-f]{16}")


#: The environment a process starter passes on to the processes it starts (`space up`: the control plane,
#: the agent, the helper), so one setting traces all of them alike.
TRACING_ENV = (
    "SPACE_TRACING", "SPACE_TRACE_SAMPLE", "SPACE_TRACE_MAX_TRACES", "SPACE_TRACE_MAX_SPANS",
    "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_HEADERS",
)  # fmt: skip


class TracingSettings(BaseSettings):
    """Tracing of one process, from the environment (SPACE_TRACING, SPACE_TRACE_*; the OTLP endpoint also
    from OpenTelemetry's own OTEL_EXPORTER_OTLP_ENDPOINT)."""

    model_config = SettingsConfigDict(env_prefix="SPACE_TRACE_", extra="ignore", populate_by_name=True)

    enabled: bool = Field(default=True, validation_alias="SPACE_TRACING")
    #: Probability that a new root trace is recorded (its children follow the parent's decision).
    sample: float = Field(default=1.0, ge=0.0, le=1.0)
    #: Traces kept in memory per process, and spans kept per trace.
    max_traces: int = Field(default=512, ge=1, le=100_000)
    max_spans: int = Field(default=256, ge=1, le=10_000)
    otlp_endpoint: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT")


def clean_attributes(attributes: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """Only allowed keys, only scalar values, strings cut short (the module invariants)."""
    cleaned: dict[str, str | int | float | bool] = {}
    for key, value in attributes.items():
        if key not in ALLOWED_ATTRIBUTES or value is None:
            continue
        if isinstance(value, bool | int | float):
            cleaned[key] = value
        elif isinstance(value, str):
            cleaned[key] = value[:MAX_VALUE]
    return cleaned


def record_of(span: ReadableSpan) -> dict[str, Any] | None:
    """A finished span as the plain record the ring keeps and the routes answer with."""
    ctx = span.context
    if ctx is None or span.start_time is None or span.end_time is None:
        return None
    parent = span.parent.span_id if span.parent is not None else 0
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent:016x}" if parent else None,
        "name": span.name[:MAX_NAME],
        "layer": span.instrumentation_scope.name if span.instrumentation_scope else "unknown",
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "error": span.status.status_code == StatusCode.ERROR,
        "attributes": clean_attributes(span.attributes or {}),
    }


def record_from_wire(value: Any) -> dict[str, Any] | None:
    """A span record another process sent (the helper's answer, a node's route), validated; None if it is
    not one. Its attributes pass `clean_attributes` again: a record never brings in a key we do not allow."""
    if not isinstance(value, dict):
        return None
    trace_id, span_id, parent = value.get("trace_id"), value.get("span_id"), value.get("parent_id")
    start, end, name, layer = (
        value.get("start_ns"),
        value.get("end_ns"),
        value.get("name"),
        value.get("layer"),
    )
    valid = (
        isinstance(trace_id, str)
        and _TRACE_ID_RE.fullmatch(trace_id) is not None
        and isinstance(span_id, str)
        and _SPAN_ID_RE.fullmatch(span_id) is not None
        and (parent is None or (isinstance(parent, str) and _SPAN_ID_RE.fullmatch(parent) is not None))
        and isinstance(start, int)
        and isinstance(end, int)
        and 0 <= start <= end
        and isinstance(name, str)
        and isinstance(layer, str)
    )
    if not valid:
        return None
    attributes = value.get("attributes")
    return {
        "trace_id": trace_id, "span_id": span_id, "parent_id": parent, "name": str(name)[:MAX_NAME],
        "layer": str(layer)[:32], "start_ns": start, "end_ns": end, "error": value.get("error") is True,
        "attributes": clean_attributes(attributes if isinstance(attributes, dict) else {}),
    }  # fmt: skip


class SpanRing(SpanProcessor):
    """The last `max_traces` traces of this process, at most `max_spans` span records each."""

    def __init__(self, max_traces: int = 512, max_spans: int = 256) -> None:
        self.max_traces = max_traces
        self.max_spans = max_spans
        self._traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        record = record_of(span)
        if record is not None:
            self.add(record)

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            spans = self._traces.get(record["trace_id"])
            if spans is None:
                spans = self._traces[record["trace_id"]] = []
                while len(self._traces) > self.max_traces:
                    self._traces.popitem(last=False)
            if len(spans) < self.max_spans and all(s["span_id"] != record["span_id"] for s in spans):
                spans.append(record)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._traces.get(trace_id, ()))

    def traces_of(self, sandbox_id: str) -> list[str]:
        """Trace ids with a span about `sandbox_id`, oldest first."""
        with self._lock:
            found = [
                (min(s["start_ns"] for s in spans), trace_id)
                for trace_id, spans in self._traces.items()
                if any(s["attributes"].get("sandbox_id") == sandbox_id for s in spans)
            ]
        return [trace_id for _start, trace_id in sorted(found)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._traces)

    def clear(self) -> None:
        with self._lock:
            self._traces.clear()

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


RING = SpanRing()
_state: dict[str, Any] = {"enabled": False, "configured": False}
_configure_lock = threading.Lock()


def configure(service: str, settings: TracingSettings | None = None) -> None:
    """Install this process's tracer provider (once; later calls change nothing): the ring always, the
    OTLP exporter when an endpoint is set and the exporter is installed."""
    with _configure_lock:
        if _state["configured"]:
            return
        settings = settings or TracingSettings()
        _state["configured"] = True
        _state["enabled"] = settings.enabled
        if not settings.enabled:
            return
        RING.max_traces, RING.max_spans = settings.max_traces, settings.max_spans
        # Not the global provider: libraries that trace themselves when one is set (FastAPI's native
        # telemetry records request bodies and exception messages) stay off; SPACE's layers use this one.
        _state["provider"] = build_provider(service, settings, RING)


def build_provider(service: str, settings: TracingSettings, ring: SpanRing) -> TracerProvider:
    """A provider that samples as `settings` say, keeps spans in `ring` and exports them over OTLP when an
    endpoint is set (and the exporter is installed)."""
    from opentelemetry.sdk.resources import Resource

    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(settings.sample)),
        resource=Resource.create({"service.name": service}),
    )
    provider.add_span_processor(ring)
    if settings.otlp_endpoint:
        _add_otlp(provider, settings.otlp_endpoint)
    return provider


def _add_otlp(provider: TracerProvider, endpoint: str) -> None:
    try:  # the optional extra `otlp` (ADR 0072); imported by name: it may not be installed
        exporter = importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    except ImportError:
        import logging

        logging.getLogger("space.tracing").warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp-proto-http is not installed: "
            "spans stay in memory only"
        )
        return
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider.add_span_processor(
        BatchSpanProcessor(exporter.OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces"))
    )


def enabled() -> bool:
    return bool(_state["enabled"])


class Layer:
    """The spans of one layer of SPACE (its instrumentation scope: the record's `layer`)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def span(
        self, name: str, *, root: bool = False, **attributes: Any
    ) -> contextlib.AbstractContextManager[Any]:
        """A span around a block: its error status when the block raises. A no-op when tracing is off, and
        (unless `root`) outside a trace: background work (polls, samplers) never fills the ring."""
        if not _state["enabled"] or not (root or _in_trace()):
            return contextlib.nullcontext()
        return _span(self.name, name, attributes)

    def start(self, name: str, **attributes: Any) -> trace.Span | None:
        """A span (in the current trace; None outside one) that ends later, by `finish` (e.g. a guest call
        that ends when its answer comes)."""
        if not _state["enabled"] or not _in_trace():
            return None
        return _tracer(self.name).start_span(name[:MAX_NAME], attributes=clean_attributes(attributes))


@functools.cache
def _tracer(layer: str) -> trace.Tracer:
    provider: TracerProvider = _state["provider"]
    return provider.get_tracer(layer)


def _in_trace() -> bool:
    return trace.get_current_span().get_span_context().is_valid


def timed(layer: Layer, name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: a span around every call of a (synchronous) function, in the current trace only."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def traced(*args: P.args, **kwargs: P.kwargs) -> R:
            if not _state["enabled"]:
                return function(*args, **kwargs)
            with layer.span(name):
                return function(*args, **kwargs)

        return traced

    return wrap


@contextlib.contextmanager
def _span(layer: str, name: str, attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
    with _tracer(layer).start_as_current_span(
        name[:MAX_NAME],
        attributes=clean_attributes(attributes),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            code = getattr(exc, "code", None)
            span.set_status(Status(StatusCode.ERROR))
            if isinstance(code, str):
                span.set_attribute("error", code[:MAX_VALUE])
            raise


def mark_error(span: Any) -> None:
    if span is not None:
        span.set_status(Status(StatusCode.ERROR))


def finish(span: trace.Span | None, *, error: bool = False) -> None:
    if span is not None:
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


def set_attributes(span: Any, **attributes: Any) -> None:
    """Attributes known only once the block ran (the matched route, the status)."""
    if span is not None and _state["enabled"]:
        span.set_attributes(clean_attributes(attributes))


# -- propagation (W3C traceparent) --------------------------------------------------------------------------
def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The remote parent a traceparent value names; None when it is absent or not a valid one."""
    if not traceparent or len(traceparent) > MAX_TRACEPARENT:
        return None
    match = _TRACEPARENT_RE.fullmatch(traceparent.strip().lower())
    if match is None:
        return None
    trace_id, span_id, flags = int(match[1], 16), int(match[2], 16), int(match[3], 16)
    if trace_id == 0 or span_id == 0:
        return None
    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 1))
    return trace.set_span_in_context(NonRecordingSpan(parent))


@contextlib.contextmanager
def attached(traceparent: str | None) -> Iterator[None]:
    """Run the block with the remote parent `traceparent` names as the current context (if it is valid)."""
    ctx = context_of(traceparent) if _state["enabled"] else None
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def traceparent() -> str | None:
    """The current span as a traceparent value; None without one (or with tracing off)."""
    if not _state["enabled"]:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags) & 1:02x}"


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` with the current traceparent added (when there is one)."""
    value = traceparent()
    if value is not None:
        headers[TRACEPARENT] = value
    return headers


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current sampled span, for a hop that carries only ids (spaced)."""
    if not _state["enabled"]:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def child_record(
    parent: tuple[str, str], name: str, layer: str, start_ns: int, end_ns: int, **attributes: Any
) -> dict[str, Any]:
    """A span record for work another process timed (spaced's own time for a call)."""
    return {
        "trace_id": parent[0], "span_id": secrets.token_hex(8), "parent_id": parent[1],
        "name": name[:MAX_NAME], "layer": layer, "start_ns": start_ns, "end_ns": max(start_ns, end_ns),
        "error": False, "attributes": clean_attributes(attributes),
    }  # fmt: skip


def descendants(records: list[dict[str, Any]], root_span_id: str) -> list[dict[str, Any]]:
    """The records under the span `root_span_id` (itself included): what one helper request recorded."""
    children: dict[str | None, list[dict[str, Any]]] = {}
    for record in records:
        children.setdefault(record["parent_id"], []).append(record)
    found: list[dict[str, Any]] = []
    todo = [r for r in records if r["span_id"] == root_span_id]
    while todo:
        record = todo.pop()
        found.append(record)
        todo.extend(children.get(record["span_id"], ()))
    return found
