"""SPACE's file entries (the daemon's stat dicts) as envd `EntryInfo` messages.

Invariants:
- `path` is absolute as the daemon resolved it; `type` is FILE, DIRECTORY or SYMLINK (anything else, a
  device or a socket, is reported as a FILE, as envd does); `mode` holds the permission bits and
  `permissions` Go's `FileMode.String()` of type and bits (`-rw-r--r--`, `drwxr-xr-x`).
- `owner`/`group` are names when the daemon reports them, else the numeric ids as text (root is "root").
- A symlink that is followed (Stat) reports its target's type and size with `symlinkTarget` = the fully
  resolved absolute target (the daemon's realpath) and `isSymlink`; a listing reports links as SYMLINK,
  not followed, with the link's text made absolute against the link's directory.
- `metadata` carries the extended attributes `user.e2b.<key>` as `<key>` (E2B's convention), when the entry
  was read with its attributes.
"""

from __future__ import annotations

import base64
import binascii
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


def metadata_of(entry: dict[str, Any]) -> dict[str, str]:
    """The `user.e2b.*` attributes of an entry read with xattrs (values base64), as E2B's metadata."""
    xattrs = entry.get("xattrs") or {}
    if not isinstance(xattrs, dict):
        return {}
    found: dict[str, str] = {}
    for key, value in xattrs.items():
        if isinstance(key, str) and key.startswith(XATTR_PREFIX) and isinstance(value, str):
            try:
                text = base64.b64decode(value, validate=True).decode("utf-8", errors="replace")
            except binascii.Error:
                continue
            found[key.removeprefix(XATTR_PREFIX)] = text
    return found


def entry_info(entry: dict[str, Any]) -> fpb.EntryInfo:
    """`entry` as EntryInfo (a followed symlink's entry describes its target and names the link)."""
    kind = str(entry.get("type", "file"))
    mode = int(entry.get("mode") or 0) & 0o7777
    info = fpb.EntryInfo(
        name=str(entry.get("name", "")),
        type=_TYPES.get(kind, fpb.FileType.FILE),
        path=str(entry.get("path", "")),
        size=int(entry.get("size") or 0),
        mode=stat_module.S_IMODE(mode),
        permissions=permissions(kind, mode),
        owner=_name_of(entry, "owner", "uid"),
        group=_name_of(entry, "group", "gid"),
        metadata=metadata_of(entry),
    )
    modified = _timestamp(entry.get("mtime"))
    if modified is not None:
        info.modified_time = modified
    if kind == "symlink" or entry.get("is_symlink"):
        resolved = entry.get("symlink_resolved")
        target = resolved if isinstance(resolved, str) and resolved else symlink_target(entry)
        if target is not None:
            info.symlink_target = target
        info.is_symlink = True
    return info


def symlink_target(entry: dict[str, Any]) -> str | None:
    """The absolute target of a symlink entry (relative targets resolved against the link's directory)."""
    target = entry.get("symlink_target") or entry.get("target")
    if not isinstance(target, str) or not target:
        return None
    if target.startswith("/"):
        return posixpath.normpath(target)
    return posixpath.normpath(posixpath.join(posixpath.dirname(str(entry.get("path", "/"))), target))
