"""Serving the E2B front beside the control plane's API: one process, one event loop, one Services.

Invariants:
- Each E2B app has its own port (E2B's SDK takes the in-sandbox URL's root, so it cannot share the
  API's): the control API (`control.create_control_app`) and the in-sandbox API
  (`envd.app.envd_app`). Both are built over the SAME Services as the SPACE API they sit beside, so they
  share its store, reconciler, node pools, caches and settings.
- The SPACE API's server owns the signals: SIGTERM/SIGINT stop it, and its end stops the E2B servers
  (which install no signal handlers of their own). An E2B server that cannot start (its port taken) is
  logged as an error and SPACE's API goes on without it: the front is an addition, never a reason for
  the API (and everything `space up` supervises through it) to be down.
- The E2B servers keep idle connections 330 s: E2B's SDK pools them for 300 s, and a server that closes
  first races the client's next request on that connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from space.controlplane.api.deps import Services
from space.core import errors
from space.rest.logs import uvicorn_log_config

log = logging.getLogger(__name__)

#: Longer than the E2B SDK's 300 s pool idle time (module invariants).
KEEP_ALIVE_S = 330


def parse_listen(value: str, what: str) -> tuple[str, int]:
    """(host, port) of a `HOST:PORT` listen address (InvalidArgument naming `what` otherwise)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.InvalidArgument(f"{what}: expected HOST:PORT, got {value!r}", field=what)
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class E2bListen:
    """Where the E2B front listens (None: that app is not served)."""

    api: str | None = None
    sandbox: str | None = None


class _Companion(uvicorn.Server):
    """A server that leaves the signals to the main one (module invariants)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _companion(
    app: ASGIApp, listen: str, what: str, *, lifespan: Literal["on", "off"], log_level: str
) -> _Companion:
    host, port = parse_listen(listen, what)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, lifespan=lifespan,
        log_config=uvicorn_log_config(),
        timeout_keep_alive=KEEP_ALIVE_S,
    )  # fmt: skip
    return _Companion(config)


def companions(services: Services, listen: E2bListen, log_level: str) -> list[uvicorn.Server]:
    # Imported here, when a front is served: the e2b package's modules take ~0.6 s to import, which every
    # control plane without the front (most of them) would pay at each start.
    from space.controlplane.e2b.control import create_control_app
    from space.controlplane.e2b.envd.app import envd_app

    servers: list[uvicorn.Server] = []
    if listen.api:
        app = create_control_app(services)
        servers.append(_companion(app, listen.api, "e2b_api_listen", lifespan="off", log_level=log_level))
    if listen.sandbox:
        sandbox = envd_app(services)
        servers.append(
            _companion(sandbox, listen.sandbox, "e2b_sandbox_listen", lifespan="on", log_level=log_level)
        )
    return servers


async def serve_with_e2b(main: uvicorn.Server, extra: list[uvicorn.Server]) -> None:
    """Run `main` and the E2B servers until `main` ends (module invariants)."""
    tasks = [asyncio.create_task(_serve_companion(server), name="e2b-server") for server in extra]
    try:
        await main.serve()
    finally:
        for server in extra:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


async def _serve_companion(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn's answer to a port it cannot bind (it logged why)
        log.error("the E2B front on %s:%s did not start; SPACE's API goes on without it",
                  server.config.host, server.config.port)  # fmt: skip


def run(app: FastAPI, *, host: str, port: int, log_level: str, listen: E2bListen) -> None:
    """Serve the SPACE API `app` on host:port, and the E2B front where `listen` says."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, log_config=uvicorn_log_config()
    )
    services: Services = app.state.services
    asyncio.run(serve_with_e2b(uvicorn.Server(config), companions(services, listen, log_level)))
