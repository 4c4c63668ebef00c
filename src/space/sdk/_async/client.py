"""The client of one SPACE server: `AsyncSpace`, and the sync `Space` generated from it.

    with Space() as sp:                          # SPACE_URL + SPACE_API_KEY, or the `space up` config file
        sb = sp.sandboxes.create(template="python")
    async with AsyncSpace() as sp:               # the same, awaited
        sb = await sp.sandboxes.create(template="python")

Invariants:
- Configuration is resolved once, at construction (arguments, then the environment, then the config
  file; space.sdk.config); the API key is sent only to the URL it was configured for.
- One client owns one connection pool; close it (or use `with` / `async with`) when done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from space.sdk._async.admin import AsyncCredentials, AsyncKeys, AsyncNodes, AsyncProjects
from space.sdk._async.http import AsyncHTTP
from space.sdk._async.sandboxes import AsyncProjectSnapshots, AsyncSandboxes
from space.sdk._async.templates import AsyncTemplates
from space.sdk.config import resolve_config

__all__ = ["AsyncSpace"]


class AsyncSpace:
    """A client of one SPACE server; with no arguments it reads SPACE_URL/SPACE_API_KEY or the `space up`
    config file."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 10.0,
        max_retries: int = 3,
        retry_backoff: float = 0.25,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        config = resolve_config(url, api_key)
        self.url = config.url
        self._http = AsyncHTTP(
            config.url,
            config.api_key,
            transport=transport,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            headers=headers,
        )
        self.sandboxes = AsyncSandboxes(self._http)
        self.projects = AsyncProjects(self._http)
        #: The cluster's nodes (organisation admin keys only, ADR 0065).
        self.nodes = AsyncNodes(self._http)
        self.keys = AsyncKeys(self._http)
        self.credentials = AsyncCredentials(self._http)
        self.templates = AsyncTemplates(self._http)
        #: The project's full snapshots by id or name (`sandbox.snapshots` are one sandbox's).
        self.snapshots = AsyncProjectSnapshots(self._http)

    async def health(self) -> dict[str, Any]:
        """GET /healthz (unauthenticated)."""
        answer = await self._http.json("GET", "/healthz")
        return dict(answer) if isinstance(answer, dict) else {"status": answer}

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncSpace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"
