"""The import path of the sync client, `from space.sdk.client import Space`; generated code is in _sync."""

from space.sdk._sync import (
    Credentials,
    Files,
    Keys,
    Process,
    Processes,
    Projects,
    Sandbox,
    Sandboxes,
    Snapshots,
    Space,
)

__all__ = [
    "Credentials",
    "Files",
    "Keys",
    "Process",
    "Processes",
    "Projects",
    "Sandbox",
    "Sandboxes",
    "Snapshots",
    "Space",
]
