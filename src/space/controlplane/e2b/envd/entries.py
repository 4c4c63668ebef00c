"""SPACE's file entries (the daemon's stat dicts) as envd `EntryInfo` messages.

Invariants:
- `path` is absolute as the daemon resolved it; `type` is FILE, DIRECTORY or SYMLINK (anything else, a
  device or a socket, is reported as a FILE, as envd does); `mode` holds the permission bits and
  `permissions` Go's `FileMode.String()` of type and bits (`-rw-r--r--`, `drwxr-xr-x`).
- `owner`/`group` are names when the daemon reports them, else the numeric ids as text (root is "root").
- A symlink that is followed (Stat) reports its target's type and size with `symlinkTarget` = the absolute
  target and `isSymlink`; a listing reports links as SYMLINK, not followed.
- `metadata` carries the daemon's extended attributes `user.e2b.<key>` as `<key>`, when it reports them.
"""

from __future__ import annotations

import posixpath
import stat as stat_module
from typing import Any

from e2b.envd.filesystem import filesystem_pb as fpb
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

_TYPES = {"file": fpb.FileType.FILE, "dir": fpb.FileType.DIRECTORY, "symlink": fpb.FileType.SYMLINK}
_TYPE_CHARS = {"dir": "d", "symlink": "L"}
XATTR_PREFIX = "user.e2b."


def permissions(kind: str, mode: int) -> str:
    bits = "".join(char if mode & (1 << (8 - i)) else "-" for i, char in enumerate("rwxrwxrwx"))
    return _TYPE_CHARS.get(kind, "-") + bits


def _name_of(entry: dict[str, Any], name_key: str, id_key: str) -> str:
    name = entry.get(name_key)
    if isinstance(name, str) and name:
        return name
    number = entry.get(id_key)
    if number == 0:
        return "root"
    return str(number) if isinstance(number, int) else ""


def _timestamp(mtime: Any) -> Timestamp | None:
    if not isinstance(mtime, int | float):
        return None
    seconds = int(mtime)
    return Timestamp(seconds=seconds, nanos=round((float(mtime) - seconds) * 1e9) % 1_000_000_000)


def _metadata(entry: dict[str, Any]) -> dict[str, str]:
    xattrs = entry.get("xattrs") or entry.get("metadata") or {}
    if not isinstance(xattrs, dict):
        return {}
    found: dict[str, str] = {}
    for key, value in xattrs.items():
        if isinstance(key, str) and key.startswith(XATTR_PREFIX) and isinstance(value, str):
            found[key.removeprefix(XATTR_PREFIX)] = value
    return found


def entry_info(entry: dict[str, Any], *, followed: dict[str, Any] | None = None) -> fpb.EntryInfo:
    """`entry` as EntryInfo; with `followed` (the stat of a symlink's target) as envd's Stat reports it."""
    shown = followed if followed is not None else entry
    kind = str(shown.get("type", "file"))
    mode = int(shown.get("mode") or 0) & 0o7777
    info = fpb.EntryInfo(
        name=str(entry.get("name", "")),
        type=_TYPES.get(kind, fpb.FileType.FILE),
        path=str(entry.get("path", "")),
        size=int(shown.get("size") or 0),
        mode=stat_module.S_IMODE(mode),
        permissions=permissions(kind, mode),
        owner=_name_of(shown, "owner", "uid"),
        group=_name_of(shown, "group", "gid"),
        metadata=_metadata(shown),
    )
    modified = _timestamp(shown.get("mtime"))
    if modified is not None:
        info.modified_time = modified
    if entry.get("type") == "symlink":
        target = symlink_target(entry)
        if target is not None:
            info.symlink_target = target
        info.is_symlink = True
    return info


def symlink_target(entry: dict[str, Any]) -> str | None:
    """The absolute target of a symlink entry (relative targets resolved against the link's directory)."""
    target = entry.get("target")
    if not isinstance(target, str) or not target:
        return None
    if target.startswith("/"):
        return posixpath.normpath(target)
    return posixpath.normpath(posixpath.join(posixpath.dirname(str(entry.get("path", "/"))), target))
