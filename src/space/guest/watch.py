"""files.watch: report created/modified/deleted paths under a file or directory until CANCEL.

Invariants:
- inotify (through ctypes on libc; gVisor implements it) when available, else a polling fallback that
  diffs os.scandir snapshots every POLL_INTERVAL. Both report the same three kinds, as full paths.
- A change may also carry a `cause` that refines its kind without changing it (hosts that do not know it
  see the three kinds as before): "renamed" on the `deleted` of a path renamed away (its new name is a
  `created`), "attrib" on a `modified` that changed only metadata (mode, owner, times: inotify's
  IN_ATTRIB; the polling fallback sees a mode change only).
- Changes are batched: once something changed, the watcher keeps collecting for BATCH_WINDOW, then sends
  one EVENT {"type": "changes"}; exact duplicates inside a batch are dropped, order is kept.
- Before the first change event the call sends EVENT {"type": "watching", "backend": ...}: changes made
  after the host has seen it are never missed.
- A recursive inotify watch adds watches for directories created later, and reports what such a directory
  already contains (it may have been filled before its watch existed). Queue overflow is reported as a
  "modified" of the watched root.
- The call checks for CANCEL at least every POLL_INTERVAL and always closes its inotify fd.
"""

from __future__ import annotations

import os
import select
import stat
import struct
import time
from typing import TYPE_CHECKING, Any, Protocol

from space.guest.channel import Call, Cancelled
from space.guest.fileinfo import resolve
from space.guest.params import get_bool
from space.guest.settings import SETTINGS
from space.protocol import methods as m

if TYPE_CHECKING:
    from space.guest.daemon import Daemon

POLL_INTERVAL = 0.2
BATCH_WINDOW = 0.05

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, name length

Change = tuple[str, str, str]  # (path, kind, cause: "" | "renamed" | "attrib")
RENAMED = "renamed"
ATTRIB = "attrib"


class Watcher(Protocol):
    backend: str

    def changes(self, timeout: float) -> list[Change]: ...

    def close(self) -> None: ...


class InotifyWatcher:
    backend = "inotify"

    def __init__(self, root: str, recursive: bool) -> None:
        import ctypes

        self._ctypes = ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        self._add_watch = libc.inotify_add_watch
        self._add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add_watch.restype = ctypes.c_int
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        self._fd: int = fd
        self._root = root
        self._recursive = recursive
        self._paths: dict[int, str] = {}
        try:
            self._watch(root)
            if recursive and os.path.isdir(root):
                self._watch_tree(root, report=None)
        except BaseException:
            self.close()
            raise

    def _watch(self, path: str) -> None:
        wd = self._add_watch(self._fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            errno = self._ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), path)
        self._paths[wd] = path

    def _watch_tree(self, top: str, report: list[Change] | None) -> None:
        for directory, dirs, files in os.walk(top):
            for name in dirs:
                path = os.path.join(directory, name)
                try:
                    self._watch(path)
                except OSError:
                    continue
                if report is not None:
                    report.append((path, "created", ""))
            if report is not None:
                report.extend((os.path.join(directory, name), "created", "") for name in files)

    def changes(self, timeout: float) -> list[Change]:
        found: list[Change] = []
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if not poller.poll(int(timeout * 1000)):
            return found
        deadline = time.monotonic() + BATCH_WINDOW
        while True:
            self._drain(found)
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(int(left * 1000) + 1):
                return _dedupe(found)

    def _drain(self, found: list[Change]) -> None:
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            pos = 0
            while pos + EVENT_HEADER.size <= len(data):
                wd, mask, _cookie, length = EVENT_HEADER.unpack_from(data, pos)
                raw_name = data[pos + EVENT_HEADER.size : pos + EVENT_HEADER.size + length]
                pos += EVENT_HEADER.size + length
                self._translate(wd, mask, os.fsdecode(raw_name.rstrip(b"\0")), found)

    def _translate(self, wd: int, mask: int, name: str, found: list[Change]) -> None:
        if mask & IN_Q_OVERFLOW:
            found.append((self._root, "modified", ""))
            return
        base = self._paths.get(wd)
        if mask & IN_IGNORED:
            self._paths.pop(wd, None)
            return
        if base is None:
            return
        path = os.path.join(base, name) if name else base
        if mask & (IN_CREATE | IN_MOVED_TO):
            found.append((path, "created", ""))
            if self._recursive and mask & IN_ISDIR:
                try:
                    self._watch(path)
                    self._watch_tree(path, report=found)
                except OSError:
                    pass
        elif mask & (IN_DELETE | IN_MOVED_FROM):
            found.append((path, "deleted", RENAMED if mask & IN_MOVED_FROM else ""))
        elif mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            if base == self._root:
                found.append((path, "deleted", RENAMED if mask & IN_MOVE_SELF else ""))
        elif mask & (IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB) and not (mask & IN_ISDIR and name == ""):
            only_metadata = not mask & (IN_MODIFY | IN_CLOSE_WRITE)
            found.append((path, "modified", ATTRIB if only_metadata else ""))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PollWatcher:
    backend = "poll"

    def __init__(self, root: str, recursive: bool) -> None:
        self._root = root
        self._recursive = recursive
        self._snapshot = self._scan()

    def _scan(self) -> dict[str, tuple[int, int, int, int]]:
        snapshot: dict[str, tuple[int, int, int, int]] = {}
        try:
            st = os.stat(self._root)
        except OSError:
            return snapshot
        snapshot[self._root] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
        pending = [self._root] if os.path.isdir(self._root) else []
        while pending:
            directory = pending.pop()
            try:
                with os.scandir(directory) as scan:
                    for entry in scan:
                        try:
                            est = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        snapshot[entry.path] = (est.st_mode, est.st_size, est.st_mtime_ns, est.st_ino)
                        if self._recursive and entry.is_dir(follow_symlinks=False):
                            pending.append(entry.path)
            except OSError:
                continue
        return snapshot

    def changes(self, timeout: float) -> list[Change]:
        time.sleep(min(timeout, POLL_INTERVAL))
        current = self._scan()
        previous, self._snapshot = self._snapshot, current
        found: list[Change] = [(path, "deleted", "") for path in previous if path not in current]
        for path, signature in current.items():
            old = previous.get(path)
            if old is None:
                found.append((path, "created", ""))
            elif old != signature and not stat.S_ISDIR(signature[0]):
                # A directory's own mtime moves with its entries, which are reported themselves.
                only_mode = old[0] != signature[0] and old[1:3] == signature[1:3]
                found.append((path, "modified", ATTRIB if only_mode else ""))
        return found

    def close(self) -> None:
        return None


def _dedupe(changes: list[Change]) -> list[Change]:
    return list(dict.fromkeys(changes))


def _change(path: str, kind: str, cause: str) -> dict[str, str]:
    return {"path": path, "kind": kind, "cause": cause} if cause else {"path": path, "kind": kind}


def open_watcher(root: str, recursive: bool) -> Watcher:
    if not SETTINGS.watch_poll:
        try:
            return InotifyWatcher(root, recursive)
        except (OSError, AttributeError, ImportError):
            pass  # no libc inotify (or no ctypes): fall back to polling
    return PollWatcher(root, recursive)


def files_watch(daemon: Daemon, call: Call, params: dict[str, Any]) -> dict[str, Any]:
    root = resolve(params)
    recursive = get_bool(params, "recursive", False)
    os.stat(root)  # a missing path is not_found now, not a silent empty watch
    watcher = open_watcher(root, recursive)
    try:
        call.event({"type": m.EVENT_WATCHING, "backend": watcher.backend})
        while not call.cancelled.is_set():
            found = watcher.changes(POLL_INTERVAL)
            if found:
                daemon.touch()
                try:
                    changes = [_change(path, kind, cause) for path, kind, cause in found]
                    call.event({"type": m.EVENT_CHANGES, "changes": changes})
                except Cancelled:
                    if call.finished:
                        raise
                    break  # cancelled while waiting for the host's credit: end as a CANCEL does
    finally:
        watcher.close()
    return {}
