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
    assert set(parsed) == {"ts", "level", "component", "logger", "msg", "request_id", "sandbox_id", "error"}
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
