"""The envd front's request limits: the same per-key limits as SPACE's API (ADR 0025), applied once the
caller is known (the envd front authenticates by its own headers, after routing).

Invariants:
- Per caller (an API key, or one sandbox's envd token), a token bucket of requests (`resource_exhausted`,
  which E2B's SDK raises as RateLimitException) and a cap on concurrent long-lived operations (Start,
  Connect, WatchDir, downloads, uploads), with the API's settings (`api_requests_per_s`,
  `api_request_burst`, `api_streams_per_key`). A slot is held until the operation's stream ends (or its
  client went away).
- Every node call of an envd request runs with `node_pools.traffic_owner` set to the caller, so it takes
  that node's tenant-fair data pool, as `/v1`'s data plane does.
- A response whose client does not take a chunk for `api_send_stall_s` is cut (`stalled_send`): a reader
  that stopped reading does not hold a node connection (and the daemon's output) for ever.
- The limits live in this process, like the API's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from starlette.types import Message, Send

from space.controlplane.api.deps import Principal, Services
from space.controlplane.api.limits import LimitSettings, StreamSlots, TokenBuckets
from space.controlplane.node_pools import traffic_owner
from space.core import errors


class EnvdLimits:
    def __init__(self, services: Services) -> None:
        self.settings = LimitSettings.of(services.settings)
        self.buckets = TokenBuckets(
            self.settings.requests_per_s, self.settings.request_burst, self.settings.max_tracked_keys
        )
        self.streams = StreamSlots(self.settings.streams_per_key)

    def admit(self, who: Principal) -> None:
        """Take a request token for the caller (ResourceExhausted when its bucket is empty)."""
        wait = self.buckets.take(who.key.id)
        if wait > 0:
            raise errors.ResourceExhausted(
                f"too many requests for this key: retry after {math.ceil(wait)} s",
                limit="requests_per_s", retry_after_s=math.ceil(wait),
            )  # fmt: skip
        traffic_owner.set(who.key.id)

    @contextlib.asynccontextmanager
    async def stream(self, who: Principal) -> AsyncIterator[None]:
        """Hold one of the caller's long-lived operation slots while the block runs."""
        if not self.streams.acquire(who.key.id):
            raise errors.ResourceExhausted(
                f"this key already has {self.settings.streams_per_key} streams open; close one first",
                limit="streams_per_key", retry_after_s=1,
            )  # fmt: skip
        try:
            yield
        finally:
            self.streams.release(who.key.id)

    def stalled_send(self, send: Send) -> Send:
        """`send`, failing a body chunk the client has not taken within `send_stall_s`."""
        stall_s = self.settings.send_stall_s

        async def timed(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                await asyncio.wait_for(send(message), stall_s)
            except TimeoutError as exc:
                raise ConnectionAbortedError(f"the client took no data for {stall_s:g} s") from exc

        return timed
