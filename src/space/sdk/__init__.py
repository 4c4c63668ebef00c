"""The Python SDK of SPACE: `Space` (sync) and `AsyncSpace` (async), over the HTTP API of docs/api.md.

    from space import Space
    sp = Space()                                 # SPACE_URL + SPACE_API_KEY, or the `space up` config file
    sb = sp.sandboxes.create(template="python")
    print(sb.exec("echo hi").stdout)

Errors are the typed classes of space.core.errors (NotFound, InvalidState with `.state`, StorageExhausted
(HTTP 507: a disk budget or reserve), ...), plus RateLimited (HTTP 429) and TransportError (cannot reach
the server; an Unavailable).

The async client is the source (space.sdk._async); the sync client (space.sdk._sync) is generated from it
by scripts/gen_sync_sdk.py, so the two have the same names, arguments and behaviour.
"""

from __future__ import annotations

from space.core.errors import (
    AlreadyExists,
    Conflict,
    InvalidArgument,
    InvalidState,
    NotFound,
    PermissionDenied,
    SpaceError,
    StorageExhausted,
    Unauthenticated,
    Unavailable,
)
from space.sdk._async import (
    AsyncFiles,
    AsyncProcess,
    AsyncProcesses,
    AsyncSandbox,
    AsyncSandboxes,
    AsyncSnapshots,
    AsyncSpace,
)
from space.sdk._sync import Files, Process, Processes, Sandbox, Sandboxes, Snapshots, Space
from space.sdk.config import ClientConfig, config_path, resolve_config, write_config_file
from space.sdk.errors import ConfigurationError, RateLimited, TransportError
from space.sdk.models import (
    ApiKey,
    Credential,
    ExecResult,
    MetricSample,
    ProcessEvent,
    Project,
    Record,
    SandboxEvent,
    Snapshot,
)

__all__ = [
    "AlreadyExists",
    "ApiKey",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSnapshots",
    "AsyncSpace",
    "ClientConfig",
    "ConfigurationError",
    "Conflict",
    "Credential",
    "ExecResult",
    "Files",
    "InvalidArgument",
    "InvalidState",
    "MetricSample",
    "NotFound",
    "PermissionDenied",
    "Process",
    "ProcessEvent",
    "Processes",
    "Project",
    "RateLimited",
    "Record",
    "Sandbox",
    "SandboxEvent",
    "Sandboxes",
    "Snapshot",
    "Snapshots",
    "Space",
    "SpaceError",
    "StorageExhausted",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "config_path",
    "resolve_config",
    "write_config_file",
]
