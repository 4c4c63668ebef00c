"""Calls on a gVisor sandbox's own control server, without starting `runsc` (ADR 0084; root helper only).

`runsc pause` and `runsc resume` each start a Go binary (~20 ms on the reference machine) that loads the
container's state, makes one call on the sandbox's control socket (`containerManager.Pause` / `Resume`) and
records the new status. A checkpoint needs the sandbox's tasks stopped around `runsc checkpoint` (the disk
snapshot must be the memory image's moment, ADR 0077), so the helper makes that one call itself (<1 ms).

Protocol (gVisor's urpc): the client writes one JSON object `{"method": M, "arg": A}` to the stream unix
socket `runsc-<container>.sock` in runsc's root directory, and the sandbox answers with one JSON object
`{"success": bool, "err": str, "result": ...}` on the same connection.

Invariants:
- Only the fixed methods of `Method` are called, and only on the socket runsc creates for the container in
  the helper's own runsc root (never a path read from a file or a request).
- The sandbox runs hostile code, so its answer is hostile input: it is read up to ANSWER_LIMIT bytes and for
  at most TIMEOUT_S; anything but a well-formed success is RuntimeFailure, with the sandbox's own message
  cut to MESSAGE_LIMIT characters.
- The sandbox counts its pauses: each Resume must answer one Pause (one too many stops the sandbox), so the
  caller keeps the record of a pause it made (space.node.helper.runtime.Runtimes.hold).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import pathlib
import socket
import time

from space.core import errors, tracing

TIMEOUT_S = 30.0
ANSWER_LIMIT = 64 * 1024
MESSAGE_LIMIT = 300
#: AF_UNIX paths are at most 107 bytes; a longer one is reached through /proc/self/fd (as runsc does).
UNIX_PATH_MAX = 107
LAYER = tracing.Layer("space.node.helper")


class Method(enum.StrEnum):
    PAUSE = "containerManager.Pause"
    RESUME = "containerManager.Resume"


def control_socket(runsc_root: pathlib.Path, container: str) -> pathlib.Path:
    return runsc_root / f"runsc-{container}.sock"


def call(runsc_root: pathlib.Path, container: str, method: Method, *, timeout: float = TIMEOUT_S) -> None:
    """Make one call on `container`'s control server; RuntimeFailure if it cannot be reached or says no."""
    path = control_socket(runsc_root, container)
    message = json.dumps({"method": str(method), "arg": None}).encode()
    with LAYER.span(f"sentry.{method.name.lower()}"):
        try:
            answer = _exchange(path, message, timeout)
        except OSError as exc:
            raise errors.RuntimeFailure(
                f"sandbox {container} cannot be reached: {exc.strerror or exc}"
            ) from exc
    if not isinstance(answer, dict):
        raise errors.RuntimeFailure(f"sandbox {container} answered {method.name.lower()} with no result")
    if answer.get("success") is not True:
        said = str(answer.get("err") or "no reason given")[:MESSAGE_LIMIT]
        raise errors.RuntimeFailure(f"sandbox {container} refused {method.name.lower()}: {said}")


def _exchange(path: pathlib.Path, message: bytes, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        _connect(conn, path)
        conn.sendall(message)
        received = bytearray()
        while True:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                chunk = conn.recv(ANSWER_LIMIT + 1 - len(received))
            except TimeoutError as exc:
                raise errors.RuntimeFailure(f"the sandbox did not answer within {timeout}s") from exc
            if not chunk:
                raise errors.RuntimeFailure("the sandbox closed its control connection without an answer")
            received += chunk
            if len(received) > ANSWER_LIMIT:
                raise errors.RuntimeFailure(f"the sandbox's answer exceeds {ANSWER_LIMIT} bytes")
            with contextlib.suppress(ValueError):  # not whole yet (JSONDecodeError, a cut UTF-8 sequence)
                return json.loads(received)


def _connect(conn: socket.socket, path: pathlib.Path) -> None:
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        conn.connect(str(path))
        return
    handle = os.open(path, os.O_PATH)
    try:
        conn.connect(f"/proc/self/fd/{handle}")
    finally:
        os.close(handle)
