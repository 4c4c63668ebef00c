"""What a file is: one stat entry per path, owner and group names, and listings by depth.

Invariants:
- An entry describes the path itself (lstat): a symlink is an entry of type "symlink" whose
  `symlink_target` is the link's text as readlink gives it, never resolved. `files.stat` with
  "follow": true describes what the link leads to (type, size, mode, owner of the target) and still names
  the link's text; a link that cannot be followed (dangling, a loop) is then described as itself with
  "broken": true. Following happens inside the sandbox, whose root is its own: a link to "/../../x" names
  a path of the sandbox, never of the host.
- Listings never descend through symlinks (no loop can make a walk endless), go at most MAX_DEPTH levels
  deep, stop after `limit` entries (at most MAX_LIST_ENTRIES) with "truncated": true, and come in
  pre-order with each directory's children sorted by name (a/, a/x, b): the order E2B's SDK expects.
- Owner and group names come from the sandbox's own passwd and group databases (pwd, grp), looked up once
  per id per call (a listing of 10 000 files owned by one user does one lookup); an id without a name has
  `owner`/`group` None and keeps its numeric `uid`/`gid`.
- Every string is valid UTF-8 (the JSON reaches HTTP clients): a name that is not is shown with U+FFFD
  replacements, and `path_b64` then carries the path's exact bytes.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import grp
import os
import pwd
import stat
from collections.abc import Callable, Iterator
from typing import Any

from space.guest.channel import GuestError
from space.guest.params import get_str
from space.guest.settings import SETTINGS

MAX_DEPTH = 16
MAX_LIST_ENTRIES = 50_000
DEFAULT_LIST_ENTRIES = MAX_LIST_ENTRIES

_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"))


def resolve(params: dict[str, Any], key: str = "path") -> str:
    """The call's path: absolute, or relative to the work directory; never empty, never with NUL."""
    path: str = get_str(params, key)
    if not path or "\x00" in path:
        raise GuestError("invalid_argument", f"{key!r} must be a non-empty path without NUL bytes")
    return os.path.join(SETTINGS.workdir, path)


class Names:
    """uid -> user name and gid -> group name, from the sandbox's own databases, cached for one call."""

    def __init__(self) -> None:
        self._users: dict[int, str | None] = {}
        self._groups: dict[int, str | None] = {}

    def user(self, uid: int) -> str | None:
        if uid not in self._users:
            try:
                self._users[uid] = _text(pwd.getpwuid(uid).pw_name)
            except (KeyError, OSError):
                self._users[uid] = None
        return self._users[uid]

    def group(self, gid: int) -> str | None:
        if gid not in self._groups:
            try:
                self._groups[gid] = _text(grp.getgrgid(gid).gr_name)
            except (KeyError, OSError):
                self._groups[gid] = None
        return self._groups[gid]


def _text(value: str) -> str:
    """A str that encodes as UTF-8 (os functions give undecodable bytes as lone surrogates)."""
    return os.fsencode(value).decode("utf-8", "replace")


def kind_of(mode: int) -> str:
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "other"


def entry(path: str, st: os.stat_result, names: Names, *, link: str | None = None) -> dict[str, Any]:
    """The entry of `path` from its stat result; `link` is the text of the symlink at `path`, if any."""
    shown = _text(path)
    described: dict[str, Any] = {
        "name": os.path.basename(shown.rstrip("/")) or "/",
        "path": shown,
        "type": kind_of(st.st_mode),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "permissions": stat.filemode(st.st_mode),
        "mtime": st.st_mtime,
        "modified": datetime.datetime.fromtimestamp(st.st_mtime, datetime.UTC).isoformat(),
        "uid": st.st_uid,
        "gid": st.st_gid,
        "owner": names.user(st.st_uid),
        "group": names.group(st.st_gid),
        "target": None if link is None else _text(link),
    }
    described["symlink_target"] = described["target"]
    if shown != path:
        described["path_b64"] = base64.b64encode(os.fsencode(path)).decode()
    return described


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None  # replaced or removed meanwhile


def describe(path: str, names: Names, *, follow: bool = False) -> dict[str, Any]:
    """The entry of `path` (lstat); with `follow`, of what a symlink at `path` leads to."""
    st = os.lstat(path)
    if not stat.S_ISLNK(st.st_mode):
        return entry(path, st, names)
    link = _readlink(path)
    if not follow:
        return entry(path, st, names, link=link)
    try:
        target_st = os.stat(path)
    except OSError:
        return entry(path, st, names, link=link) | {"broken": True}
    return entry(path, target_st, names, link=link) | {
        "is_symlink": True,
        "symlink_resolved": _text(os.path.realpath(path)),
    }


def _children(directory: str) -> list[str]:
    """The names in `directory`, sorted (names only: a huge directory costs its names, not its stats)."""
    with os.scandir(directory) as scan:
        return sorted(item.name for item in scan)


def walk(root: str, depth: int, names: Names) -> Iterator[dict[str, Any]]:
    """Entries below `root` (not root itself) up to `depth` levels, pre-order, children sorted by name.

    The root must be a directory (else not_a_directory / not_found from the OS). A subdirectory that
    vanishes or cannot be read while walking is listed but not entered.
    """
    stack: list[tuple[str, int, Iterator[str]]] = [(root, 1, iter(_children(root)))]
    while stack:
        directory, level, pending = stack[-1]
        name = next(pending, None)
        if name is None:
            stack.pop()
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # removed while listing
        link = _readlink(path) if stat.S_ISLNK(st.st_mode) else None
        yield entry(path, st, names, link=link)
        if level < depth and stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                stack.append((path, level + 1, iter(_children(path))))


#: JSON of an entry's keys, numbers, booleans and permissions string: well under this many bytes.
_FIXED_ENTRY_BYTES = 400


def _text_bound(text: str | None) -> int:
    """Bytes `text` can take in JSON (ensure_ascii: at most 12 per character, a surrogate pair)."""
    if not text:
        return 4
    return len(text) + 2 if text.isascii() else 12 * len(text) + 2


def json_size_bound(item: dict[str, Any]) -> int:
    """An upper bound of len(json.dumps(item)) for an entry, several times cheaper than encoding it."""
    size = _FIXED_ENTRY_BYTES + 2 * _text_bound(item["path"]) + 2 * _text_bound(item.get("target"))
    size += _text_bound(item.get("owner")) + _text_bound(item.get("group")) + len(item.get("path_b64") or "")
    size += _text_bound(item.get("symlink_resolved"))
    for name, value in (item.get("xattrs") or {}).items():
        size += _text_bound(name) + len(value) + 4
    return size


def list_in_batches(
    root: str, depth: int, limit: int, emit: Callable[[list[dict[str, Any]]], None],
    *, batch_bytes: int, decorate: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """Walk `root`, handing full batches (about `batch_bytes` of JSON each) to `emit`; returns the last
    batch and whether the walk stopped at `limit` entries with more left."""
    names = Names()
    batch: list[dict[str, Any]] = []
    size = 0
    for count, item in enumerate(walk(root, depth, names)):
        if count == limit:
            return batch, True
        if decorate is not None:
            decorate(item)
        cost = json_size_bound(item)
        if batch and size + cost > batch_bytes:
            emit(batch)
            batch, size = [], 0
        batch.append(item)
        size += cost
    return batch, False
