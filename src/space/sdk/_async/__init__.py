"""The client classes of one side of the SDK, async (space.sdk._async) or sync (space.sdk._sync).

The async side is hand-written, the one source of both; scripts/gen_sync_sdk.py generates the sync side
from it with `unasync`: `async`/`await` go, `Async*` names become their sync twins (AsyncSpace -> Space,
AsyncHTTP -> SyncHTTP). What differs beyond that lives in space.sdk._backend; what needs no I/O lives in
space.sdk.models and space.sdk._policy. `make check` fails while the generated copy is stale.
"""

from space.sdk._async.admin import AsyncCredentials, AsyncKeys, AsyncNodes, AsyncProjects
from space.sdk._async.client import AsyncSpace
from space.sdk._async.files import AsyncFiles
from space.sdk._async.processes import AsyncProcess, AsyncProcesses
from space.sdk._async.sandboxes import (
    AsyncProjectSnapshots,
    AsyncSandbox,
    AsyncSandboxes,
    AsyncSandboxPage,
    AsyncSnapshots,
)
from space.sdk._async.templates import AsyncTemplates

__all__ = [
    "AsyncCredentials",
    "AsyncFiles",
    "AsyncKeys",
    "AsyncNodes",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncProjectSnapshots",
    "AsyncProjects",
    "AsyncSandbox",
    "AsyncSandboxPage",
    "AsyncSandboxes",
    "AsyncSnapshots",
    "AsyncSpace",
    "AsyncTemplates",
]
