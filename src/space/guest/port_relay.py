"""A relay between a process's stdin/stdout and a TCP port on the sandbox's loopback (ADR 0064).

Run inside a sandbox as a plain process (standard library only, no SPACE import: it is executed as a file):

    python3 -I -S -B port_relay.py version PORT START   print the service's /json/version document, exit
    python3 -I -S -B port_relay.py pipe PORT START      one line: that document; then raw bytes both ways

The node starts it through the daemon's process calls, so nothing outside the sandbox ever opens a
connection into the sandbox's network: the bytes travel in the sandbox's own channel. If nothing listens on
PORT, START (an executable) is run once, detached in a session of its own, under a lock (concurrent relays
start one service), and the port is awaited for at most START_WAIT_S.

Exit status: 0 when either side ended the stream (stdin's end ends the process), 3 when the service
could not be reached.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

START_WAIT_S = 30.0
LOCK = "/tmp/.space-port-relay-{port}.lock"


def _connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError:
        return None


def _ensure_listening(port: int, start: str) -> bool:
    sock = _connect(port)
    if sock is not None:
        sock.close()
        return True
    with open(LOCK.format(port=port), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(port)  # another relay may have started it while this one waited
        if sock is None:
            try:
                subprocess.Popen(  # the template's own start script
                    [start], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as exc:  # not a browser template: no start script
                sys.stderr.write(f"cannot start {start}: {exc.strerror}\n")
                return False
            deadline = time.monotonic() + START_WAIT_S
            while sock is None and time.monotonic() < deadline:
                time.sleep(0.1)
                sock = _connect(port)
        if sock is None:
            return False
        sock.close()
    return _version(port) is not None


def _version(port: int) -> bytes | None:
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:  # the port opens a moment before the HTTP handler answers
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/json/version")
            answer = conn.getresponse()
            body = answer.read()
            conn.close()
            if answer.status == 200:
                json.loads(body)
                return body
        except (OSError, ValueError, http.client.HTTPException):
            pass
        time.sleep(0.2)
    return None


def _pipe(sock: socket.socket) -> None:
    def upstream() -> None:
        while True:
            data = os.read(0, 65536)
            if not data:
                break
            sock.sendall(data)
        # The client went away: so does this connection, whole (a half-closed one would keep the client's
        # session in the service, e.g. Chromium's auto-attach pausing new pages for a debugger that left).
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        os._exit(0)

    threading.Thread(target=upstream, daemon=True).start()
    out = sys.stdout.buffer
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        out.write(data)
        out.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("version", "pipe") or not argv[1].isdigit():
        sys.stderr.write("usage: port_relay.py version|pipe PORT START\n")
        return 2
    mode, port, start = argv[0], int(argv[1]), argv[2]
    if not _ensure_listening(port, start):
        sys.stderr.write(f"nothing answers on 127.0.0.1:{port}\n")
        return 3
    body = _version(port)
    if body is None:
        sys.stderr.write(f"127.0.0.1:{port} does not answer /json/version\n")
        return 3
    line = json.dumps(json.loads(body), separators=(",", ":")).encode() + b"\n"
    sys.stdout.buffer.write(line)
    sys.stdout.buffer.flush()
    if mode == "version":
        return 0
    sock = _connect(port)
    if sock is None:
        return 3
    sock.settimeout(None)
    _pipe(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
