"""The in-sandbox (envd) front as one ASGI app, served at the root of its own port.

Invariants:
- Routes by path prefix only: `/process.Process/*` and `/filesystem.Filesystem/*` go to connectrpc's ASGI
  applications built from the `e2b` package's generated service classes (the Connect protocol, its
  codecs, envelopes and error encoding are the library's, not ours); a request with `E2b-Sandbox-Port:
  49999` goes to the code interpreter's routes (`space.controlplane.e2b.code_interpreter`, ADR 0058);
  everything else is `files_rest`.
- RPC request bodies are bounded by RPC_READ_MAX_BYTES (connectrpc answers `resource_exhausted`
  beyond); uploads by the control plane's `max_upload_bytes`.
- Every request runs under the front's limits (`limits`: per-key rate and streams, the node pools'
  tenant-fair data traffic, a cut for a client that stops reading).
- The app holds no state of its own but the polling watchers (closed at shutdown: lifespan) and the limits.
"""

from __future__ import annotations

from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.types import ASGIApp, Receive, Scope, Send

from space.controlplane.api.deps import Services
from space.controlplane.e2b.code_interpreter import code_interpreter_app, is_code_interpreter
from space.controlplane.e2b.envd.codecs import envd_codecs
from space.controlplane.e2b.envd.files_rest import rest_app
from space.controlplane.e2b.envd.filesystem_service import FilesystemService
from space.controlplane.e2b.envd.keepalive import watching_disconnect
from space.controlplane.e2b.envd.limits import EnvdLimits
from space.controlplane.e2b.envd.process_service import ProcessService
from space.controlplane.e2b.envd.watchers import Watchers
from space.rest.request_id import RequestIdMiddleware

RPC_READ_MAX_BYTES = 4 << 20


def envd_app(services: Services) -> ASGIApp:
    """E2B's in-sandbox API over `services` (the control plane's own)."""
    watchers = Watchers()
    limits = EnvdLimits(services)
    process = ProcessASGIApplication(
        ProcessService(services, limits), read_max_bytes=RPC_READ_MAX_BYTES, codecs=envd_codecs()
    )
    filesystem = FilesystemASGIApplication(
        FilesystemService(services, limits, watchers), read_max_bytes=RPC_READ_MAX_BYTES, codecs=envd_codecs()
    )
    rest = rest_app(services, limits)
    code = code_interpreter_app(services, limits)
    routes: tuple[tuple[str, ASGIApp], ...] = (
        (process.path + "/", process),
        (filesystem.path + "/", filesystem),
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, watchers)
            return
        if scope["type"] != "http":
            return  # no WebSockets here: E2B's PTY is a process RPC
        path = scope["path"]
        send = limits.stalled_send(send)
        if is_code_interpreter(scope):
            await code(scope, receive, send)
            return
        for prefix, rpc in routes:
            if path.startswith(prefix):
                await rpc(scope, watching_disconnect(receive), send)
                return
        await rest(scope, receive, send)

    return RequestIdMiddleware(app, issue=True, quiet=r"^/health$")  # as SPACE's API (ADR 0071)


async def _lifespan(receive: Receive, send: Send, watchers: Watchers) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await watchers.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
