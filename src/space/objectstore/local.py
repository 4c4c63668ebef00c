"""An object store in a local directory: the embedded default (one machine, or a shared filesystem).

Invariants:
- Object `a/b/c` is the file `<root>/a/b/c`; key validation (base.validate_key) keeps every path under root.
- `put` writes a temporary file in the destination directory, fsyncs it, renames it over the destination
  and fsyncs the directory: after `put` returns, the object survives a crash, and a crash during `put`
  leaves either the old object or none, plus at most a temporary file that `list` never reports (its name
  contains "~", which no key may contain) and that the next `put` of that key does not depend on;
  `delete_prefix` removes such files along with the objects under the prefix.
- Files are created 0600 (mkstemp, kept by the rename) and directories 0700: only the owning user (the node
  agent) reads objects; a root directory this user owns is made 0700 when the store is opened, even if an
  older run or an operator created it with a wider mode.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from space.core import errors
from space.objectstore.base import ObjectStore, validate_key, validate_prefix

TEMP_MARK = "~tmp~"


class LocalDirectoryStore(ObjectStore):
    def __init__(self, root: Path) -> None:
        root = Path(root)
        if not root.is_absolute():
            raise errors.InvalidArgument(f"object store directory must be absolute: {root}")
        self.root = root
        self.url = root.as_uri()
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = root.stat()
            if info.st_uid == os.geteuid() and info.st_mode & 0o077:
                root.chmod(info.st_mode & 0o700)
        except OSError as exc:
            raise errors.Unavailable(f"cannot create object store directory {root}: {exc}") from exc

    @classmethod
    def from_url(cls, url: str) -> LocalDirectoryStore:
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or parts.query:
            raise errors.InvalidArgument(f"invalid local object store url {url!r} (use file:///abs/dir)")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise errors.InvalidArgument(f"local object store url needs an absolute path: {url!r}")
        store = cls(Path(path))
        store.url = url
        return store

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        for attempt in range(10):
            try:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
                break
            except (FileNotFoundError, FileExistsError) as exc:
                # A concurrent delete removed a (then empty) directory between mkdir and mkstemp, or
                # within mkdir's own exists-check. A real file-vs-directory clash persists: Conflict.
                if attempt == 9:
                    raise _translate(exc, key) from exc
            except OSError as exc:
                raise _translate(exc, key) from exc
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise _translate(exc, key) from exc
        _fsync_dir(path.parent)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise errors.NotFound(f"object {key!r} not found", key=key) from exc
        except OSError as exc:
            raise _translate(exc, key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        validate_prefix(prefix)
        found = [
            base + name
            for _directory, base, names in _walk(self.root, prefix)
            for name in names
            if TEMP_MARK not in name and (base + name).startswith(prefix)
        ]
        found.sort()
        return found

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _translate(exc, key) from exc
        self._remove_empty_parents(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`, and the temporary files that puts of keys under it left
        when their process was killed mid-write: deleting a sandbox's prefix leaves nothing of it."""
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        self._delete_temporaries(prefix)
        return len(keys)

    def _delete_temporaries(self, prefix: str) -> None:
        left: list[Path] = []
        for dirpath, base, names in _walk(self.root, prefix):
            for name in names:
                # ".<name>~tmp~<random>" is an interrupted put of key <base><name> (see put).
                interrupted = name.startswith(".") and TEMP_MARK in name
                if interrupted and (base + name[1:].split(TEMP_MARK, 1)[0]).startswith(prefix):
                    left.append(Path(dirpath) / name)
        for path in left:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._remove_empty_parents(path.parent)

    def _remove_empty_parents(self, directory: Path) -> None:
        # Empty directories are clutter, not state; a concurrent put recreates what it needs (mkdir -p).
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent


def _walk(root: Path, prefix: str) -> Iterator[tuple[str, str, list[str]]]:
    """(directory, its key prefix "a/b/", file names) of every directory that may hold keys under
    `prefix`. Only the deepest directory the prefix names is walked (its last partial segment filters by
    name), and subtrees that cannot match are pruned, so a listing under a deep prefix stays cheap."""
    directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    start = root / directory if directory else root
    if not start.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(start):
        rel_dir = os.path.relpath(dirpath, root)
        base = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if _may_match(base + d + "/", prefix)]
        yield dirpath, base, filenames


def _may_match(directory_prefix: str, prefix: str) -> bool:
    return directory_prefix.startswith(prefix) or prefix.startswith(directory_prefix)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _translate(exc: OSError, key: str) -> errors.SpaceError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.ResourceExhausted(f"object store is full writing {key!r}", key=key)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return errors.PermissionDenied(f"object store refused access to {key!r}", key=key)
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        return errors.Conflict(f"object key {key!r} collides with a directory of other keys", key=key)
    return errors.Unavailable(f"object store I/O error on {key!r}: {exc.strerror}", key=key)
