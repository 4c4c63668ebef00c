"""The helper's client of a sandbox's control socket (space.node.helper.sentry, ADR 0084) against a server
that plays the sandbox, honest or hostile.

- What goes out is one urpc call naming one of the fixed methods, with no argument.
- An honest success answers; a refusal is RuntimeFailure carrying the sandbox's message, cut short.
- A hostile sandbox cannot hang or flood the helper: an answer that never comes times out, an endless one is
  cut at the limit, garbage or a closed connection is RuntimeFailure, and so is a socket that is not there.
- A socket path longer than AF_UNIX allows is still reached (through /proc/self/fd).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from space.core import errors
from space.node.helper import sentry

Behaviour = Callable[[socket.socket, bytes], None]


def _answer(value: object) -> Behaviour:
    return lambda conn, _request: conn.sendall(json.dumps(value).encode())


@pytest.fixture()
def sandbox(tmp_path: pathlib.Path) -> Iterator[Callable[..., tuple[pathlib.Path, list[bytes]]]]:
    """A fake control server for container `c-0` under a runsc root; returns the root and the requests."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def start(behaviour: Behaviour, root: pathlib.Path = tmp_path) -> tuple[pathlib.Path, list[bytes]]:
        root.mkdir(parents=True, exist_ok=True)
        path = sentry.control_socket(root, "c-0")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(
            str(path.relative_to(pathlib.Path.cwd()))
            if path.is_relative_to(pathlib.Path.cwd())
            else str(path)
        )
        listener.listen(1)
        listeners.append(listener)
        requests: list[bytes] = []

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                request = conn.recv(65536)
                requests.append(request)
                behaviour(conn, request)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return root, requests

    yield start
    for listener in listeners:
        listener.close()
    for thread in threads:
        thread.join(timeout=5)


def test_a_call_names_a_fixed_method_with_no_argument_and_a_success_answers(sandbox) -> None:  # type: ignore[no-untyped-def]
    root, requests = sandbox(_answer({"success": True, "err": "", "result": None}))
    sentry.call(root, "c-0", sentry.Method.PAUSE)
    assert json.loads(requests[0]) == {"method": "containerManager.Pause", "arg": None}


def test_a_refusal_is_a_runtime_failure_with_the_sandboxs_message_cut_short(sandbox) -> None:  # type: ignore[no-untyped-def]
    root, _ = sandbox(_answer({"success": False, "err": "Invalid stopCount " + "x" * 10_000, "result": None}))
    with pytest.raises(errors.RuntimeFailure, match="refused resume: Invalid stopCount") as caught:
        sentry.call(root, "c-0", sentry.Method.RESUME)
    assert len(str(caught.value)) < sentry.MESSAGE_LIMIT + 100


@pytest.mark.parametrize(
    "answer",
    [[True], "success", 1, None, {"success": "true"}],
    ids=["list", "string", "number", "null", "success-not-a-bool"],
)
def test_an_answer_that_is_not_a_success_object_is_a_runtime_failure(sandbox, answer: object) -> None:  # type: ignore[no-untyped-def]
    root, _ = sandbox(_answer(answer))
    with pytest.raises(errors.RuntimeFailure):
        sentry.call(root, "c-0", sentry.Method.PAUSE)


def test_an_answer_that_never_comes_times_out(sandbox) -> None:  # type: ignore[no-untyped-def]
    release = threading.Event()
    root, _ = sandbox(lambda conn, _request: release.wait(5))
    try:
        with pytest.raises(errors.RuntimeFailure, match=r"did not answer within 0\.3s"):
            sentry.call(root, "c-0", sentry.Method.PAUSE, timeout=0.3)
    finally:
        release.set()


def test_an_answer_that_never_ends_is_cut_at_the_limit(sandbox) -> None:  # type: ignore[no-untyped-def]
    def flood(conn: socket.socket, _request: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client hung up, as it should
            conn.sendall(b'{"success": true, "err": "' + b"a" * (sentry.ANSWER_LIMIT * 4))

    root, _ = sandbox(flood)
    with pytest.raises(errors.RuntimeFailure, match="exceeds"):
        sentry.call(root, "c-0", sentry.Method.PAUSE)


@pytest.mark.parametrize(
    "sent", [b"", b'{"success": tr', b"\xff\xfe garbage"], ids=["nothing", "cut", "garbage"]
)
def test_a_connection_closed_without_a_whole_answer_is_a_runtime_failure(sandbox, sent: bytes) -> None:  # type: ignore[no-untyped-def]
    root, _ = sandbox(lambda conn, _request: conn.sendall(sent))
    with pytest.raises(errors.RuntimeFailure, match="closed its control connection"):
        sentry.call(root, "c-0", sentry.Method.PAUSE)


def test_a_socket_that_is_not_there_is_a_runtime_failure(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.RuntimeFailure, match="cannot be reached"):
        sentry.call(tmp_path, "c-0", sentry.Method.PAUSE)


def test_a_socket_path_longer_than_af_unix_allows_is_reached(sandbox, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)  # the fake server binds it relative (it could not otherwise)
    assert len(str(sentry.control_socket(deep, "c-0"))) > sentry.UNIX_PATH_MAX
    root, requests = sandbox(_answer({"success": True, "err": "", "result": None}), root=deep)
    sentry.call(root, "c-0", sentry.Method.RESUME)
    assert json.loads(requests[0])["method"] == "containerManager.Resume"
