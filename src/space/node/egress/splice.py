"""Spliced tunnels: TLS (or other TCP) the gateway does not terminate, passed through byte for byte after
the decision, and the ClientHello checks that keep a tunnel to the host it was decided for.

Invariants:
- A ClientHello's SNI must name the host the decision was made for (CONNECT target or transparent SNI);
  ECH, which hides the real server name, is refused. A CONNECT tunnel whose client speaks TLS has its
  ClientHello checked before a byte of it goes upstream.
- A tunnel that moved no byte in either direction for `tunnel_idle_timeout` is closed, so a sandbox cannot
  hold thousands of silent tunnels (file descriptors, upstream sockets) open forever.
- The upstream connection of a tunnel is tracked under its sandbox (a policy change can close it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from space.core import errors
from space.node.egress.context import ActiveConnection, GatewayContext
from space.node.egress.policy import Destination, normalize_host
from space.node.egress.tls import ClientHello, NotTls, read_client_hello
from space.node.egress.upstream import READ_SIZE, Connected, close_writer

TLS_HANDSHAKE_RECORD = b"\x16"


class Activity:
    """When a spliced tunnel last moved a byte in either direction (loop time)."""

    def __init__(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def touch(self) -> None:
        self.last = asyncio.get_running_loop().time()


async def close_when_idle(activity: Activity, idle_s: float, close: Callable[[], None]) -> None:
    """Close a spliced tunnel once neither direction moved a byte for `idle_s`."""
    loop = asyncio.get_running_loop()
    while True:
        remaining = activity.last + idle_s - loop.time()
        if remaining <= 0:
            close()
            return
        await asyncio.sleep(remaining)


async def pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: Activity | None = None
) -> None:
    """Copy `reader` to `writer` until end of stream (then half-close the writer)."""
    try:
        while True:
            data = await reader.read(READ_SIZE)
            if not data:
                break
            if activity is not None:
                activity.touch()
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


def hello_acceptable(
    ctx: GatewayContext, sandbox_id: str, destination: Destination, hello: ClientHello
) -> bool:
    """Does `hello` go to `destination` (no ECH; an SNI, if any, naming that host)? Audits a refusal."""
    if hello.has_ech:
        ctx.audit("egress", sandbox_id, destination.host, "refused", reason="encrypted ClientHello")
        return False
    if hello.server_name is None:
        return True
    try:
        sni: Destination | None = normalize_host(hello.server_name)
    except errors.InvalidArgument:
        sni = None
    if sni != destination:
        ctx.audit(
            "egress",
            sandbox_id,
            destination.host,
            "refused",
            reason="TLS server name differs from the CONNECT host",
            sni=hello.server_name[:255],
        )
        return False
    return True


class Splice:
    """One spliced tunnel between a sandbox's connection and its (already connected) upstream."""

    def __init__(
        self,
        ctx: GatewayContext,
        sandbox_id: str,
        destination: Destination,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        connected: Connected,
    ) -> None:
        self.ctx = ctx
        self.sandbox_id = sandbox_id
        self.destination = destination
        self.reader, self.writer = client
        self.up_reader, self.up_writer, self.address = connected

    def close(self) -> None:
        close_writer(self.up_writer)
        close_writer(self.writer)

    async def run(self, initial: bytes, *, hello_checked: bool) -> None:
        """Pass bytes both ways until both ends are done (or the tunnel idles out). `initial`: client bytes
        already read; `hello_checked`: they are a ClientHello that was checked (else the client's first bytes
        are checked here if they are TLS: a CONNECT tunnel)."""
        activity = Activity()
        watchdog = asyncio.ensure_future(close_when_idle(activity, self.ctx.tunnel_idle_timeout, self.close))
        track = self.ctx.track(self.sandbox_id, ActiveConnection(self.destination, self.address, self.close))
        try:
            await asyncio.gather(
                self._client_to_upstream(initial, activity, hello_checked=hello_checked),
                pipe(self.up_reader, self.writer, activity),
                return_exceptions=True,
            )
        finally:
            watchdog.cancel()
            self.ctx.untrack(track)
            self.close()

    async def _client_to_upstream(self, initial: bytes, activity: Activity, *, hello_checked: bool) -> None:
        first = initial if hello_checked else await self._opening(initial)
        if first is None:
            return
        if first:
            activity.touch()
            self.up_writer.write(first)
            await self.up_writer.drain()
        await pipe(self.reader, self.up_writer, activity)

    async def _opening(self, first: bytes) -> bytes | None:
        """CONNECT: the client's first bytes decide whether this is TLS (then its SNI must match); the
        upstream may speak first meanwhile (the other direction already runs). None: nothing to send, the
        client direction is over (end of stream, or a refused ClientHello: the tunnel is closed)."""
        if not first:
            first = await asyncio.wait_for(self.reader.read(READ_SIZE), timeout=self.ctx.idle_timeout)
            if not first:
                if self.up_writer.can_write_eof():
                    self.up_writer.write_eof()
                return None
        if first[:1] != TLS_HANDSHAKE_RECORD:
            return first
        try:
            seen = await asyncio.wait_for(
                read_client_hello(self.reader, first), timeout=self.ctx.hello_timeout
            )
        except (NotTls, TimeoutError):
            self.ctx.audit("egress", self.sandbox_id, self.destination.host, "refused", reason="bad TLS")
            self.close()
            return None
        if not hello_acceptable(self.ctx, self.sandbox_id, self.destination, seen):
            self.close()
            return None
        return seen.raw
