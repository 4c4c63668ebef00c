"""Connections from the gateway to upstream servers.

Invariants:
- The gateway connects to addresses the policy checked (the check is pinned), never to a name.
- An upstream connection is keyed by (sandbox, host, port, tls, pinned address): it is only ever reused
  for that same key (GatewayContext's pool enforces it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from dataclasses import dataclass

import h11

from space.core import errors
from space.node.egress.policy import IPAddress

READ_SIZE = 256 * 1024
#: sandbox id, host, port, tls, pinned address
UpstreamKey = tuple[str, str, int, bool, str]
Connected = tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress]


@dataclass
class Upstream:
    """One HTTP connection to an upstream server, framed by its own h11 client connection."""

    key: UpstreamKey
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: h11.Connection
    track_id: int
    idle_since: float = 0.0

    def alive(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()


def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream, whatever state it is in (closing twice, or a broken transport, is not an error)."""
    with contextlib.suppress(Exception):
        writer.close()


async def connect(
    addresses: tuple[IPAddress, ...],
    port: int,
    *,
    tls_host: str | None,
    tls_context: ssl.SSLContext | None,
    timeout: float,
) -> Connected:
    """Connect to the first reachable checked address (never to a name: the check is pinned). With
    `tls_host`, speak TLS to it, verifying the certificate for that name against `tls_context`."""
    last: Exception | None = None
    for address in addresses:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    str(address),
                    port,
                    ssl=tls_context if tls_host is not None else None,
                    server_hostname=tls_host,
                    limit=READ_SIZE,
                ),
                timeout=timeout,
            )
        except (OSError, TimeoutError) as exc:
            last = exc
            continue
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer, address
    raise errors.Unavailable(f"cannot connect upstream on port {port}: {last}")
