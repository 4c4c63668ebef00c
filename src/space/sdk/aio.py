"""The import path of the async client, `from space.sdk.aio import AsyncSpace`; the code is in _async."""

from space.sdk._async import (
    AsyncCredentials,
    AsyncFiles,
    AsyncKeys,
    AsyncProcess,
    AsyncProcesses,
    AsyncProjects,
    AsyncSandbox,
    AsyncSandboxes,
    AsyncSnapshots,
    AsyncSpace,
)

__all__ = [
    "AsyncCredentials",
    "AsyncFiles",
    "AsyncKeys",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncProjects",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSnapshots",
    "AsyncSpace",
]
