"""The log line formats (ADR 0071): one JSON object per record with fixed keys, or text naming the ids; the
request id accepted from a caller only when it is a short safe token."""

from __future__ import annotations

import io
import json
import logging

import pytest

from space.core import errors, request_ids
from space.rest import log_records


def _record(name: str, msg: str, *, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, (), exc_info)


def test_a_json_line_has_the_documented_keys_and_the_bound_ids() -> None:
    formatter = log_records.JsonFormatter("agent")
    with request_ids.bound("req_abc", "sb-aaaaaaaaaaaaaaaaaaaaaaaaaa"):
        line = formatter.format(_record("space.node.rpc", "two\nlines", exc=True))
    assert "\n" not in line  # one record, one line
    parsed = json.loads(line)
    keys = {"ts", "level", "component", "logger", "msg", "request_id", "sandbox_id", "trace_id", "span_id"}
    assert set(parsed) == keys | {"error"}
    assert parsed["msg"] == "two\nlines" and parsed["level"] == "warning" and parsed["component"] == "agent"
    assert parsed["request_id"] == "req_abc" and parsed["sandbox_id"] == "sb-aaaaaaaaaaaaaaaaaaaaaaaaaa"
    assert "ValueError: boom" in parsed["error"]
    outside = json.loads(formatter.format(_record("space.node.rpc", "x")))
    assert outside["request_id"] is None and outside["error"] is None  # bound() restored the previous ids


def test_the_egress_gateway_logs_as_its_own_component() -> None:
    formatter = log_records.JsonFormatter("agent")
    assert json.loads(formatter.format(_record("space.node.egress.dns", "x")))["component"] == "gateway"
    assert json.loads(formatter.format(_record("space.node.egressive", "x")))["component"] == "agent"


def test_text_lines_name_the_ids_on_the_message_line() -> None:
    formatter = log_records.TextFormatter("controlplane")
    with request_ids.bound("req_1"):
        text = formatter.format(_record("space.access", "GET /x 200", exc=True))
    first = text.splitlines()[0]
    assert " controlplane WARNING space.access: GET /x 200 [request_id=req_1]" in first
    assert "[request_id" not in formatter.format(_record("space.access", "no ids"))


def test_configure_writes_json_to_the_stream() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        log_records.configure("helper", level="info", log_format="json", stream=stream)
        logging.getLogger("space.node.helper").info("ready")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert json.loads(stream.getvalue())["msg"] == "ready"


def test_the_format_is_text_json_or_a_named_error() -> None:
    assert log_records.parse_format(None) == "text" and log_records.parse_format("") == "text"
    assert log_records.parse_format("json") == "json"
    with pytest.raises(errors.InvalidArgument, match="SPACE_LOG_FORMAT"):
        log_records.parse_format("yaml")


@pytest.mark.parametrize(
    "hostile",
    [
        "a\nb",
        "a\r\nX-Evil: 1",
        '{"level":"error"}',
        'x","level":"error',
        "x" * 10_000,
        "",
        " ab",
        "-ab",
        "a b",
        "é",
        "a" * 65,
    ],
)
def test_a_hostile_request_id_is_replaced_never_kept(hostile: str) -> None:
    accepted = request_ids.accept(hostile)
    assert accepted.startswith("req_") and accepted != hostile and len(accepted) == 20
    assert request_ids.accept_known(hostile) is None  # the node agent drops it


def test_a_short_token_is_kept() -> None:
    for good in ("abc", "A.b_c-9", "a" * 64, "req_0123456789abcdef"):
        assert request_ids.accept(good) == good == request_ids.accept_known(good)


def test_a_step_context_keeps_the_request_s_id_or_makes_a_step_id() -> None:
    alone = request_ids.step_context("sb-aaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert alone.get(request_ids.current_request_id, "").startswith("step_")
    assert alone.get(request_ids.current_sandbox_id) == "sb-aaaaaaaaaaaaaaaaaaaaaaaaaa"
    with request_ids.bound("req_driving"):
        driven = request_ids.step_context("sb-aaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert driven.get(request_ids.current_request_id) == "req_driving"
    assert request_ids.current_request_id.get() is None  # the caller's context is untouched


def test_a_line_written_after_its_span_names_the_ids_it_was_given() -> None:
    """The access line of a request is written when its span has ended: it carries the ids it was given
    (TRACE_IDS_ATTR); text shows the trace id's first TEXT_TRACE_CHARS digits (ADR 0079)."""
    record = _record("space.rest.request_id", "GET /v1/sandboxes 200 1.0ms")
    setattr(record, log_records.TRACE_IDS_ATTR, ("a" * 32, "b" * 16))
    parsed = json.loads(log_records.JsonFormatter("controlplane").format(record))
    assert (parsed["trace_id"], parsed["span_id"]) == ("a" * 32, "b" * 16)
    text = log_records.TextFormatter("controlplane").format(record)
    assert text.endswith(f"200 1.0ms [trace={'a' * log_records.TEXT_TRACE_CHARS}]")
    plain = log_records.TextFormatter("controlplane").format(_record("space.x", "no span here"))
    assert (
        "trace=" not in plain
        and json.loads(log_records.JsonFormatter("controlplane").format(_record("space.x", "none")))[
            "trace_id"
        ]
        is None
    )
