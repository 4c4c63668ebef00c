"""A fault-injecting HTTP proxy on loopback in front of the test S3 server (tests/support/s3server.py).

`FaultyProxy(upstream, schedule)` listens on 127.0.0.1:<free port>; point an S3 store URL's `endpoint` at
`proxy.endpoint` and every request passes through it. For each request the `FaultSchedule` picks at most
one fault, from a seeded random stream keyed by the request's sequence number (so a seed names one
schedule of faults, whatever the timing):

- `reset_before`      the connection closes before the request reaches the server (nothing applied)
- `reset_after`       the server applied the request, the connection closes before the answer
- `partial_headers`   the server applied it, a few bytes of the status line arrive, then the close
- `status_500`, `status_503`, `slowdown_503`   an S3 error answer instead of forwarding (nothing applied)
- `slow`              the answer is delayed and trickled out in small pieces
- `truncate`          headers with the full Content-Length, then part of the body, then the close
- `flip_response`     one bit of an object GET's body flipped (the length is kept)
- `flip_request`      one bit of a PUT's body flipped before the server stores it

Every injected fault is recorded as a `FaultEvent` (sequence number, method, path, kind), so tests can
count faults per kind and tie a flipped bit to what the client did next. Only loopback is ever contacted.
One request per connection: the server (moto/werkzeug) answers `Connection: close`, and so does the proxy.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FAULT_KINDS = (
    "reset_before",
    "reset_after",
    "partial_headers",
    "status_500",
    "status_503",
    "slowdown_503",
    "slow",
    "truncate",
    "flip_response",
    "flip_request",
)
_MAX_HEADER = 64 << 10
_ERROR_CODES = {
    "status_500": (500, "Internal Server Error", "InternalError"),
    "status_503": (503, "Service Unavailable", "ServiceUnavailable"),
    "slowdown_503": (503, "Slow Down", "SlowDown"),
}


@dataclass(frozen=True)
class FaultEvent:
    seq: int
    method: str
    path: str
    kind: str
    detail: str = ""


@dataclass
class FaultSchedule:
    """Which fault (if any) request number `seq` gets: a pure function of (seed, seq, request shape).

    `rate` is the probability of a fault per request; `kinds` the faults to draw from (weights equal, except
    `slowdown_503`, which botocore backs off for a second, at a quarter weight); `only`, when given, limits
    faults to the requests it accepts (method, path), e.g. every PUT of a manifest."""

    seed: int
    rate: float = 0.3
    kinds: tuple[str, ...] = FAULT_KINDS
    only: Callable[[str, str], bool] | None = None

    def pick(self, seq: int, method: str, path: str, has_body: bool) -> str | None:
        rng = random.Random(f"{self.seed}:{seq}")
        if rng.random() >= self.rate or (self.only is not None and not self.only(method, path)):
            return None
        kinds = [k for k in self.kinds if _applies(k, method, path, has_body)]
        if not kinds:
            return None
        weights = [0.25 if k == "slowdown_503" else 1.0 for k in kinds]
        return rng.choices(kinds, weights)[0]

    def rng(self, seq: int) -> random.Random:
        return random.Random(f"{self.seed}:{seq}:detail")


def _is_object_path(path: str) -> bool:
    """Path-style `/bucket/key` (not a bucket listing `/bucket?list-type=2...`)."""
    parts = urlsplit(path)
    return parts.path.strip("/").count("/") >= 1 and not parts.query


def _applies(kind: str, method: str, path: str, has_body: bool) -> bool:
    if kind == "flip_request":
        return method == "PUT" and has_body
    if kind == "flip_response":
        return method == "GET" and _is_object_path(path)
    if kind == "truncate":
        return method != "HEAD"
    return True


@dataclass
class _Request:
    method: str
    path: str
    head: bytes  # request line and headers, up to and including the blank line
    body: bytes


@dataclass
class FaultyProxy:
    upstream: str  # http://127.0.0.1:PORT of the real server
    schedule: FaultSchedule
    events: list[FaultEvent] = field(default_factory=list)
    requests: list[tuple[int, str, str]] = field(default_factory=list)  # every request: (seq, method, path)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: int = 0

    def __post_init__(self) -> None:
        target = urlsplit(self.upstream)
        assert target.hostname == "127.0.0.1", "the proxy forwards to loopback only"
        self._target = (target.hostname, int(target.port or 80))
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3faults", daemon=True)
        self._thread.start()

    def reset(self, schedule: FaultSchedule) -> None:
        """Start a new schedule, from request 0, with no events recorded (between runs; none in flight)."""
        with self._lock:
            self.schedule = schedule
            self.events.clear()
            self.requests.clear()
            self._seq = 0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(event.kind for event in self.events)

    def events_of(self, kind: str) -> list[FaultEvent]:
        with self._lock:
            return [event for event in self.events if event.kind == kind]

    def requests_after(self, seq: int, method: str, path: str) -> int:
        """How many later requests repeated (method, path): a client's retry of request `seq`."""
        with self._lock:
            return sum(1 for s, m, p in self.requests if s > seq and m == method and p == path)

    # --- one connection ----------------------------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        try:
            request = _read_request(client)
            if request is None:
                return
            with self._lock:
                seq = self._seq
                self._seq += 1
                self.requests.append((seq, request.method, request.path))
            kind = self.schedule.pick(seq, request.method, request.path, bool(request.body))
            self._handle(client, seq, request, kind)
        except OSError:
            pass  # the client went away: nothing to answer
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()

    def _record(self, seq: int, request: _Request, kind: str, detail: str = "") -> None:
        with self._lock:
            self.events.append(FaultEvent(seq, request.method, request.path, kind, detail))

    def _handle(self, client: socket.socket, seq: int, request: _Request, kind: str | None) -> None:
        rng = self.schedule.rng(seq)
        if kind == "reset_before":
            self._record(seq, request, kind)
            return
        if kind in _ERROR_CODES:
            self._record(seq, request, kind)
            client.sendall(_error_answer(request.method, *_ERROR_CODES[kind]))
            return
        if kind == "flip_request":
            body, detail = _flip(request.body, rng)
            self._record(seq, request, kind, detail)
            request = _Request(request.method, request.path, request.head, body)
        answer = self._forward(request)
        head, _, body = answer.partition(b"\r\n\r\n")
        head += b"\r\n\r\n"
        if kind == "reset_after":
            self._record(seq, request, kind)
        elif kind == "partial_headers":
            self._record(seq, request, kind)
            client.sendall(head[: rng.randint(1, min(20, len(head) - 1))])
        elif kind == "truncate" and body:
            cut = rng.randrange(len(body))
            self._record(seq, request, kind, f"{cut}/{len(body)}")
            client.sendall(head + body[:cut])
        elif kind == "truncate":  # nothing to cut: lose the answer instead
            self._record(seq, request, "reset_after")
        elif kind == "flip_response" and body and answer.startswith(b"HTTP/1.1 200"):
            body, detail = _flip(body, rng)
            self._record(seq, request, kind, detail)
            client.sendall(head + body)
        elif kind == "slow":
            self._record(seq, request, kind)
            _trickle(client, head + body, rng)
        else:
            client.sendall(answer)

    def _forward(self, request: _Request) -> bytes:
        with socket.create_connection(self._target, timeout=30) as upstream:
            upstream.sendall(request.head + request.body)
            chunks = []
            while chunk := upstream.recv(1 << 16):
                chunks.append(chunk)
        return b"".join(chunks)


def _flip(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    bit = rng.randrange(len(data) * 8)
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped), f"bit {bit} of {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"


def _trickle(client: socket.socket, answer: bytes, rng: random.Random) -> None:
    time.sleep(rng.uniform(0.05, 0.3))
    pieces = rng.randint(2, 5)
    step = max(1, len(answer) // pieces)
    for start in range(0, len(answer), step):
        client.sendall(answer[start : start + step])
        time.sleep(rng.uniform(0.0, 0.05))


def _error_answer(method: str, status: int, reason: str, code: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected by the test proxy</Message></Error>"
    ).encode()
    sent = b"" if method == "HEAD" else body
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(sent)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + sent


def _read_request(client: socket.socket) -> _Request | None:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = client.recv(1 << 16)
        if not chunk:
            return None
        buffer += chunk
        if len(buffer) > _MAX_HEADER:
            raise OSError("request head too large")
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raise OSError("chunked request bodies are not supported by the test proxy")
    length = int(headers.get("content-length", "0"))
    if headers.get("expect", "").lower() == "100-continue" and len(rest) < length:
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # botocore holds a PUT body back until then
    body = rest
    while len(body) < length:
        chunk = client.recv(min(1 << 16, length - len(body)))
        if not chunk:
            return None
        body += chunk
    # Forward with "Connection: close" so the upstream answer ends at EOF.
    kept = [line for line in lines[1:] if not line.lower().startswith(("connection:", "expect:"))]
    new_head = "\r\n".join([lines[0], *kept, "Connection: close"]).encode("latin-1") + b"\r\n\r\n"
    return _Request(method, path, new_head, body[:length])
