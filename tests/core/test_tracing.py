"""space.core.tracing (ADR 0072): the bounded ring, hostile trace contexts, the attribute allowlist, the
records other processes send, and tracing switched off."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from opentelemetry import trace

from space.core import tracing
from space.protocol import trace_ids


@pytest.fixture(autouse=True)
def _traced() -> None:
    tracing.configure("test")  # once per process; tests of other modules may have done it
    assert tracing.enabled()


def record(trace_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "trace_id": trace_id, "span_id": secrets.token_hex(8), "parent_id": None, "name": "x", "layer": "t",
        "start_ns": 1, "end_ns": 2, "error": False, "attributes": {}, **extra,
    }  # fmt: skip


def test_the_ring_keeps_the_newest_traces_and_a_bounded_number_of_spans_each() -> None:
    ring = tracing.SpanRing(max_traces=3, max_spans=2)
    ids = [secrets.token_hex(16) for _ in range(5)]
    for trace_id in ids:
        for _ in range(4):
            ring.add(record(trace_id))
    assert len(ring) == 3
    assert ring.trace(ids[0]) == [] and ring.trace(ids[1]) == []
    assert [len(ring.trace(t)) for t in ids[2:]] == [2, 2, 2]
    same = record(ids[4])
    ring.add(same)  # a full trace takes nothing more; a span already kept is never kept twice
    assert len(ring.trace(ids[4])) == 2


def test_traces_of_a_sandbox_are_found_by_its_id_oldest_first() -> None:
    ring = tracing.SpanRing()
    first, second, other = (secrets.token_hex(16) for _ in range(3))
    ring.add(record(second, start_ns=20, end_ns=30, attributes={"sandbox_id": "sb-a"}))
    ring.add(record(first, start_ns=10, end_ns=15, attributes={"sandbox_id": "sb-a"}))
    ring.add(record(other, attributes={"sandbox_id": "sb-b"}))
    assert ring.traces_of("sb-a") == [first, second]


def test_spans_record_the_tracer_layer_and_nest_under_the_current_span() -> None:
    outer_span = tracing.Layer("space.test").span("outer", root=True, sandbox_id="sb-x")
    with outer_span as outer, tracing.Layer("space.inner").span("inner", verb="create"):
        pass
    trace_id = f"{outer.get_span_context().trace_id:032x}"
    spans = {s["name"]: s for s in tracing.RING.trace(trace_id)}
    assert spans["inner"]["parent_id"] == spans["outer"]["span_id"]
    assert spans["inner"]["layer"] == "space.inner" and spans["outer"]["layer"] == "space.test"
    assert spans["outer"]["attributes"] == {"sandbox_id": "sb-x"}


def test_a_child_span_outside_any_trace_is_not_made() -> None:
    with tracing.Layer("space.test").span("lonely") as span:
        assert span is None


def test_attributes_other_than_the_allowed_scalars_are_dropped() -> None:
    secret = "s3cr3t-" + secrets.token_hex(8)
    with tracing.Layer("space.test").span(
        "op", root=True, sandbox_id="sb-y", env=secret, password=secret, command=["ls", secret]
    ) as span:
        span.set_attribute("authorization", secret)  # even set directly on the span
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert secret not in repr(tracing.RING.trace(trace_id))
    assert tracing.clean_attributes({"route": "x" * 1000, "env": "v"}) == {"route": "x" * tracing.MAX_VALUE}


@pytest.mark.parametrize(
    "value",
    [
        None, "", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01",
        "00-" + "a" * 32 + "-" + "0" * 16 + "-01", "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",
        "00-" + "a" * 31 + "-" + "b" * 16 + "-01", "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + "x" * 10_000,
        "\x00" * 55, "00-" + "g" * 32 + "-" + "b" * 16 + "-01",
    ],
)  # fmt: skip
def test_a_hostile_traceparent_is_ignored(value: str | None) -> None:
    assert tracing.context_of(value) is None
    with tracing.attached(value):
        assert not trace.get_current_span().get_span_context().is_valid


def test_a_valid_traceparent_is_continued() -> None:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    with tracing.attached(f"00-{trace_id}-{span_id}-01"), tracing.Layer("space.test").span("child") as span:
        assert tracing.traceparent() == f"00-{trace_id}-{span.get_span_context().span_id:016x}-01"
    (kept,) = tracing.RING.trace(trace_id)
    assert kept["parent_id"] == span_id


def test_an_unsampled_parent_records_nothing() -> None:
    trace_id = secrets.token_hex(16)
    with tracing.attached(f"00-{trace_id}-{secrets.token_hex(8)}-00"), tracing.Layer("t").span("child"):
        assert tracing.current_ids() is None
    assert tracing.RING.trace(trace_id) == []


def test_records_from_another_process_are_validated() -> None:
    good = record(secrets.token_hex(16), attributes={"verb": "create", "env": "SECRET"})
    assert tracing.record_from_wire(good) == {**good, "attributes": {"verb": "create"}}
    for bad in (
        "x",
        {**good, "trace_id": "Z" * 32},
        {**good, "span_id": 5},
        {**good, "start_ns": 3, "end_ns": 2},
        {**good, "parent_id": "nothex!!"},
        {**good, "name": None},
    ):
        assert tracing.record_from_wire(bad) is None


def test_descendants_are_the_spans_under_one_span() -> None:
    t = secrets.token_hex(16)
    root, child, grandchild, stranger = record(t), record(t), record(t), record(t)
    child["parent_id"], grandchild["parent_id"] = root["span_id"], child["span_id"]
    found = tracing.descendants([root, child, grandchild, stranger], root["span_id"])
    assert sorted(r["span_id"] for r in found) == sorted(r["span_id"] for r in (root, child, grandchild))


def test_switched_off_spans_are_a_shared_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracing._state, "enabled", False)
    with tracing.Layer("t").span("op", root=True) as span:
        assert span is None
        assert tracing.traceparent() is None
    assert tracing.Layer("t").start("op") is None


def test_trace_ids_on_the_private_channel_are_validated() -> None:
    assert trace_ids.valid_trace_id(secrets.token_hex(16))
    for bad in (None, 5, "0" * 32, "A" * 32, "a" * 33, "a" * 31):
        assert not trace_ids.valid_trace_id(bad)
    assert trace_ids.valid_timing(5) and not trace_ids.valid_timing(True) and not trace_ids.valid_timing(-1)
    assert not trace_ids.valid_timing(10**30) and not trace_ids.valid_timing(1.5)


def test_a_sample_of_zero_records_no_new_trace_but_follows_a_sampled_parent() -> None:
    ring = tracing.SpanRing()
    provider = tracing.build_provider("test", tracing.TracingSettings(sample=0.0), ring)
    tracer = provider.get_tracer("space.test")
    with tracer.start_as_current_span("root") as root:
        assert not root.get_span_context().trace_flags.sampled
    assert len(ring) == 0
    trace_id = secrets.token_hex(16)
    with tracing.attached(f"00-{trace_id}-{secrets.token_hex(8)}-01"), tracer.start_as_current_span("child"):
        pass
    assert [r["name"] for r in ring.trace(trace_id)] == ["child"]


def test_the_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACE_TRACING", "off")
    monkeypatch.setenv("SPACE_TRACE_SAMPLE", "0.25")
    monkeypatch.setenv("SPACE_TRACE_MAX_TRACES", "7")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.example.com:4318")
    settings = tracing.TracingSettings()
    assert (settings.enabled, settings.sample, settings.max_traces) == (False, 0.25, 7)
    assert settings.otlp_endpoint == "http://collector.example.com:4318"
    monkeypatch.setenv("SPACE_TRACE_SAMPLE", "2")
    with pytest.raises(ValueError):
        tracing.TracingSettings()
