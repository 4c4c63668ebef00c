"""HTTP/1.1 message rules shared by the stages of an exchange: the hop-by-hop headers, the head size limit,
reading one h11 event, and the refusal a stage raises.

Invariants:
- Hop-by-hop headers (and whatever a Connection header names) never cross the gateway in either direction.
- A request or response head is at most MAX_HEAD bytes (h11 refuses a bigger one: a 400 to the sandbox).
- A peer that sends nothing for the idle timeout ends the exchange (TimeoutError).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import h11

from space.node.egress.upstream import READ_SIZE

Header = tuple[bytes, bytes]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
    }
)
MAX_HEAD = 64 * 1024  # request/response head (big cookies, long URLs)


class Refused(Exception):
    """A stage refuses the request: the gateway answers `status` itself and closes the client connection."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def next_event(conn: h11.Connection, read: Callable[[int], Awaitable[bytes]], timeout: float) -> Any:
    """The next h11 event of `conn`, reading from `read` as needed (each read within `timeout`)."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await asyncio.wait_for(read(READ_SIZE), timeout=timeout))


def connection_tokens(headers: Iterable[Header]) -> set[bytes]:
    """The header names a Connection header declares hop-by-hop (lower case)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            tokens |= {t.strip().lower() for t in value.split(b",")}
    return tokens
