"""Fuzzing spaced's request handlers (space.guest) through its real dispatcher: the daemon runs on its
channel (tests/support/guest_harness.py) with its work directory in a temporary directory, and gets CALLs
of every method with fuzzed params: wrong types, missing and extra keys, NUL bytes, odd paths.

Property: every call ends with a RESULT or a typed ERROR (never the `internal` code that an unexpected
exception maps to, space.guest.channel.error_payload), and the daemon keeps answering. Paths are confined
to the work directory (relative, no '..' segment) so that file calls cannot touch the host: the guest
itself runs inside a sandbox, here it runs on the test host. Commands run only /bin/true.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from space.protocol import methods as m
from tests.support.fuzzing import SCALARS, executed, fuzz_settings
from tests.support.guest_harness import Guest

SEGMENT = st.text(alphabet="ab._- \u00e9\x00", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
PATH = st.lists(SEGMENT, min_size=1, max_size=3).map("/".join)
VALUE = (
    PATH | SCALARS | st.lists(SCALARS, max_size=3) | st.dictionaries(st.text(max_size=5), SCALARS, max_size=2)
)
FILE_METHODS = [
    m.FILES_READ,
    m.FILES_WRITE,
    m.FILES_LIST,
    m.FILES_STAT,
    m.FILES_MKDIR,
    m.FILES_REMOVE,
    m.FILES_RENAME,
    m.FILES_CHMOD,
]
FILE_KEYS = ["path", "src", "dst", "mode", "offset", "length", "recursive", "parents", "append", "x"]
PROCESS_METHODS = [m.PROCESS_LIST, m.PROCESS_SIGNAL, m.PROCESS_RESIZE, m.PROCESS_ATTACH, m.PROCESS_INPUT]
PROCESS_KEYS = ["process_id", "signal", "group", "rows", "cols", "offset", "x"]
START_KEYS = ["env", "cwd", "user", "timeout", "background", "pty", "cmd", "x"]


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    workdir = tmp_path_factory.mktemp("fuzz-work")
    g = Guest(env={"SPACED_WORKDIR": str(workdir)})
    yield g
    g.close()


def _confined(value: Any) -> Any:
    """A path-like string stays relative and inside the work directory; everything else as generated."""
    if isinstance(value, str):
        return "/".join(s for s in value.lstrip("/").split("/") if s not in (".", "..")) or "a"
    return value


def _assert_typed(guest: Guest, method: str, params: dict[str, Any], body: bytes | None) -> None:
    reply = guest.call(method, params, body=body, timeout=20)
    assert reply.terminal is not None, f"{method} {params!r}: no answer"
    if not reply.ok:
        assert reply.error["code"] != "internal", f"{method} {params!r}: {reply.error}"


@fuzz_settings(40)
@given(st.sampled_from(FILE_METHODS), st.dictionaries(st.sampled_from(FILE_KEYS), VALUE, max_size=4))
def test_file_calls_answer_typed(guest: Guest, method: str, params: dict[str, Any]) -> None:
    executed(f"guest.{method}")
    params = {k: _confined(v) if k in ("path", "src", "dst") else v for k, v in params.items()}
    _assert_typed(guest, method, params, b"fuzz" if method in m.BODY_METHODS else None)


@fuzz_settings(30)
@given(st.sampled_from(PROCESS_METHODS), st.dictionaries(st.sampled_from(PROCESS_KEYS), VALUE, max_size=3))
def test_process_calls_answer_typed(guest: Guest, method: str, params: dict[str, Any]) -> None:
    executed(f"guest.{method}")
    _assert_typed(guest, method, params, b"" if method in m.BODY_METHODS else None)


@fuzz_settings(30)
@given(
    st.dictionaries(st.sampled_from(START_KEYS), VALUE, max_size=4), st.lists(st.text(max_size=8), max_size=3)
)
def test_process_start_answers_typed(guest: Guest, params: dict[str, Any], args: list[str]) -> None:
    executed("guest.process.start")
    if "cmd" in params:  # both cmd and argv: refused; only ever /bin/true either way
        params["cmd"] = "/bin/true"
    if isinstance(params.get("cwd"), str):
        params["cwd"] = _confined(params["cwd"])
    _assert_typed(guest, m.PROCESS_START, {**params, "argv": ["/bin/true", *args]}, b"")


@fuzz_settings(30)
@given(
    st.text(max_size=20) | st.sampled_from(sorted(m.SYSTEM_PREFIX + s for s in ("ping", "info", "x"))), VALUE
)
def test_unknown_methods_and_params_answer_typed(guest: Guest, method: str, params: Any) -> None:
    executed("guest.dispatch")
    stream = guest.open(method, params if isinstance(params, dict) else {"p": params})
    reply = guest.collect(stream, timeout=20)
    assert reply.terminal is not None and (reply.ok or reply.error["code"] != "internal"), reply
    assert guest.call(m.SYS_PING).ok


def test_a_timeout_of_days_does_not_stop_the_output_pump(guest: Guest) -> None:
    """Found by fuzzing: a timeout longer than poll()'s C int of milliseconds (~24.8 days) overflowed it and
    ended the process's output thread, so the call never answered (flaky: only when the pump polled before
    the process exited). A process that outlives the first poll makes it deterministic."""
    reply = guest.call(
        m.PROCESS_START, {"argv": ["/bin/sleep", "0.3"], "timeout": 3_162_482}, body=b"", timeout=20
    )
    assert reply.terminal is not None and reply.ok, reply
