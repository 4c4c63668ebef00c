"""Connection pools of the control plane to one node: control traffic and data traffic apart (ADR 0025).

Invariants:
- Control traffic (the reconciler, lifecycle calls of the API, egress pushes) and data traffic (the
  data-plane relay of tenants) never share a connection pool: no number of tenant streams can make a
  lifecycle call wait for a connection. A call is data traffic exactly when `traffic_owner` is set (the
  API's limits middleware sets it to the key id for data-plane requests; NodePool.client picks the pool).
- In the data pool, one owner (API key) has at most `data_per_owner` calls in flight to one node; a call
  that cannot get a slot (or a pooled connection) within `data_wait_s` fails with ResourceExhausted (429,
  Retry-After) instead of waiting for ever.
- A node the operator gave a unix socket (PoolSettings.sockets: its registered URL -> a path on this
  machine) is reached through that socket, both pools alike, with the same node token; no node can name a
  socket (a registered URL is http(s) only), so no node can point the control plane at another local socket.
- No node answer is waited for without bound: a data call whose node sends no byte for `data_idle_s` is
  closed (httpx read timeout: between any two reads, headers included), a control call is answered whole
  within `control_total_s`, and a JSON answer larger than the pool's cap is refused (TooLarge) before it
  is held in memory whole (the gateway relays JSON answers whole).
- A node registered at an https URL is called over TLS whose certificate must verify against `ca_file`
  (SPACE_NODES_CA_FILE), else the system trust store: a certificate that does not verify fails the call
  (httpx ConnectError, Unavailable to callers), never retried in plain HTTP. An http URL is called as is.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, fields

import httpx

from space.controlplane.settings import ControlPlaneSettings, default_of
from space.core import errors
from space.node.agent.rpc_listen import KEEPALIVE_S as NODE_KEEPALIVE_S

#: The owner (API key id) of the data-plane request being served; None for control traffic.
traffic_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar("traffic_owner", default=None)


@dataclass(frozen=True)
class PoolSettings:
    """The bounds of the pools: ControlPlaneSettings' `pool_<field>` fields (SPACE_NODE_POOL_<FIELD>)."""

    control_connections: int = default_of("pool_control_connections")
    control_total_s: float = default_of("pool_control_total_s")
    control_max_json_bytes: int = default_of("pool_control_max_json_bytes")
    data_connections: int = default_of("pool_data_connections")
    data_per_owner: int = default_of("pool_data_per_owner")
    data_wait_s: float = default_of("pool_data_wait_s")
    data_idle_s: float = default_of("pool_data_idle_s")
    data_max_json_bytes: int = default_of("pool_data_max_json_bytes")
    sockets: str = default_of("pool_sockets")
    #: PEM CA bundle for nodes at https URLs (ControlPlaneSettings.nodes_ca_file); None: the system's.
    ca_file: str | None = None

    @classmethod
    def of(cls, settings: ControlPlaneSettings) -> PoolSettings:
        bounds = {
            spec.name: getattr(settings, "pool_" + spec.name)
            for spec in fields(cls)
            if spec.name != "ca_file"
        }
        node_tls_context(settings.nodes_ca_file)  # a CA file that cannot be loaded stops the start here
        return cls(**bounds, ca_file=settings.nodes_ca_file)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PoolSettings:
        return cls.of(ControlPlaneSettings.from_env(environ))

    def socket_for(self, url: str) -> str | None:
        """The unix socket the operator named for the node registered at `url` (None: reach it by TCP)."""
        return parse_sockets(self.sockets).get(url.rstrip("/"))

    def control_transport(self, uds: str | None = None) -> BoundedTransport:
        return BoundedTransport(
            connections=self.control_connections,
            total_s=self.control_total_s,
            max_json_bytes=self.control_max_json_bytes,
            uds=uds,
            tls=node_tls_context(self.ca_file),
        )

    def data_transport(self, uds: str | None = None) -> BoundedTransport:
        return BoundedTransport(
            connections=self.data_connections,
            per_owner=self.data_per_owner,
            wait_s=self.data_wait_s,
            idle_s=self.data_idle_s,
            max_json_bytes=self.data_max_json_bytes,
            uds=uds,
            tls=node_tls_context(self.ca_file),
        )


@functools.cache
def node_tls_context(ca_file: str | None) -> ssl.SSLContext:
    """The TLS context the pools verify https nodes with (made once per CA file: every node's pools share
    it): hostname checked, the certificate chain verified against `ca_file`, else the system trust store.
    Unavailable if the file cannot be loaded (the control plane then does not start half-configured)."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise errors.Unavailable(f"nodes CA file {ca_file} cannot be loaded: {exc}") from exc


#: The longest path a unix socket address holds (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107


def parse_sockets(spec: str) -> dict[str, str]:
    """`URL=PATH,...` (SPACE_NODE_POOL_SOCKETS, the server's --node-socket) as {node url: socket path};
    InvalidArgument naming the entry that is not an http(s) url and an absolute path that fits."""
    found: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        url, sep, path = entry.partition("=")
        if not sep or not url.startswith(("http://", "https://")) or not path.startswith("/"):
            raise errors.InvalidArgument(
                f"node socket {entry!r}: expected URL=PATH (an http(s) url, an absolute path)",
                field="node_sockets",
            )
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise errors.InvalidArgument(
                f"node socket path {path!r} is longer than {MAX_SOCKET_PATH} bytes", field="node_sockets"
            )
        found[url.rstrip("/")] = path
    return found


#: An idle pooled connection is dropped after this long: under the node agent's keep-alive timeout
#: (rpc_listen.KEEPALIVE_S), so the pool never sends a request on a connection the node is closing at that
#: moment (a POST lost that way fails with a ReadError and is not retried; found by the load benchmark),
#: yet long enough that a sandbox used every few seconds keeps its connection (ADR 0044).
KEEPALIVE_EXPIRY_S = float(NODE_KEEPALIVE_S - 5)


class BoundedTransport(httpx.AsyncBaseTransport):
    """A connection pool with the bounds of the module invariants (one per node and traffic class)."""

    def __init__(
        self,
        *,
        connections: int,
        max_json_bytes: int,
        per_owner: int | None = None,
        wait_s: float | None = None,
        idle_s: float | None = None,
        total_s: float | None = None,
        inner: httpx.AsyncBaseTransport | None = None,
        uds: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`uds`: connect to this unix socket instead of the request's host and port. `tls`: what https
        nodes are verified with (default: node_tls_context(None), the system trust store)."""
        self._inner = inner or httpx.AsyncHTTPTransport(
            verify=tls or node_tls_context(None),
            limits=httpx.Limits(
                max_connections=connections,
                max_keepalive_connections=min(connections, 32),
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            uds=uds,
        )
        self.uds = uds
        self.per_owner = per_owner
        self.wait_s = wait_s
        self.idle_s = idle_s
        self.total_s = total_s
        self.max_json_bytes = max_json_bytes
        self._owners: dict[str, tuple[asyncio.Semaphore, int]] = {}  # owner -> (slots, holders + waiters)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = dict(request.extensions.get("timeout") or {})
        if self.wait_s is not None:
            timeouts["pool"] = _least(timeouts.get("pool"), self.wait_s)
        if self.idle_s is not None:
            timeouts["read"] = _least(timeouts.get("read"), self.idle_s)
        request.extensions = {**request.extensions, "timeout": timeouts}
        deadline = None if self.total_s is None else asyncio.get_running_loop().time() + self.total_s
        release = await self._slot(traffic_owner.get())
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._inner.handle_async_request(request)
        except TimeoutError:
            release()
            raise httpx.ReadTimeout(f"no answer within {self.total_s} s", request=request) from None
        except httpx.PoolTimeout as exc:
            release()
            raise errors.ResourceExhausted(
                "no free connection to the node right now; retry", retry_after_s=1
            ) from exc
        except BaseException:
            release()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        json_cap = self.max_json_bytes if _is_json(response.headers.get("content-type", "")) else None
        response.stream = _BoundedStream(response.stream, request, deadline, json_cap, release)
        return response

    async def _slot(self, owner: str | None) -> Callable[[], None]:
        if owner is None or self.per_owner is None:
            return lambda: None
        slots, users = self._owners.get(owner) or (asyncio.Semaphore(self.per_owner), 0)
        self._owners[owner] = (slots, users + 1)

        def leave() -> None:
            current, count = self._owners[owner]
            if count <= 1:
                del self._owners[owner]
            else:
                self._owners[owner] = (current, count - 1)

        try:
            await asyncio.wait_for(slots.acquire(), self.wait_s)
        except TimeoutError:
            leave()
            raise errors.ResourceExhausted(
                f"this API key already has {self.per_owner} calls in flight to this node; retry",
                retry_after_s=1,
            ) from None
        except BaseException:
            leave()
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slots.release()
                leave()

        return release

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedStream(httpx.AsyncByteStream):
    """A response body read within the call's deadline, JSON answers capped; the owner's slot is freed
    when it is closed."""

    def __init__(
        self,
        inner: httpx.AsyncByteStream,
        request: httpx.Request,
        deadline: float | None,
        max_bytes: int | None,
        on_close: Callable[[], None],
    ) -> None:
        self._inner = inner
        self._request = request
        self._deadline = deadline
        self._max_bytes = max_bytes
        self._on_close = on_close

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self._inner.__aiter__()
        total = 0
        while True:
            try:
                async with asyncio.timeout_at(self._deadline):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise httpx.ReadTimeout(
                    "the node's answer did not end in time", request=self._request
                ) from None
            total += len(chunk)
            if self._max_bytes is not None and total > self._max_bytes:
                raise errors.TooLarge(
                    f"the node's JSON answer exceeds {self._max_bytes} bytes, more than the gateway holds:"
                    " ask for less (a narrower listing, a streamed exec)",
                    limit_bytes=self._max_bytes,
                )
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._on_close()


def _is_json(content_type: str) -> bool:
    return content_type.split(";", maxsplit=1)[0].strip().lower() == "application/json"


def _least(current: float | None, bound: float) -> float:
    return bound if current is None else min(current, bound)
