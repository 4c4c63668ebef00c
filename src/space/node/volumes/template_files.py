"""The small tools the template builders share (space.node.volumes.templates, .template_base): locks,
atomic metadata files, running build commands, and discarding a half-built layer.

Invariants:
- Metadata files are replaced atomically (written, fsynced, renamed): a reader sees the old file or the
  new one, never a torn one.
- Build commands run as argv lists (no shell) and fail as typed RuntimeFailure with their output's tail.
- A discarded layer leaves nothing mounted inside it and nothing on disk.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from space.core.errors import RuntimeFailure
from space.node.volumes import btrfs

Progress = Callable[[str], None]

METADATA_FORMAT = 1
#: A root filesystem's files are the guest's and get a Debian system's modes, not the owner-only umask that
#: the helper itself runs with (ADR 0022): what the template builders write into one is given its mode
#: explicitly, and what they run on one (debootstrap, chroot) runs with this umask.
ROOTFS_UMASK = 0o022


def default_progress(line: str) -> None:
    # debootstrap's stage lines ("I: Retrieving ...", "I: Extracting ...") and our own "space: ..." lines.
    if line.startswith(("I: ", "W: ", "E: ", "space: ")):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def run(argv: list[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)
    except FileNotFoundError as exc:
        raise RuntimeFailure(f"{what}: {argv[0]} is not installed") from exc
    except subprocess.CalledProcessError as exc:
        detail = ((exc.stderr or "") + (exc.stdout or "")).strip()[-2000:]
        raise RuntimeFailure(f"{what} failed: {detail}", argv=argv) from exc


def tree_size(root: Path) -> int:
    """Allocated bytes of a directory tree, each hard-linked inode counted once."""
    seen: set[int] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def unmount_under(path: Path) -> None:
    """Unmount whatever a killed debootstrap/chroot left mounted inside `path` (deepest first)."""
    prefix = os.path.realpath(path) + "/"
    with open("/proc/self/mounts") as f:
        targets = [line.split()[1].replace("\\040", " ") for line in f]
    for target in sorted((t for t in targets if t.startswith(prefix)), key=len, reverse=True):
        run(["umount", "-l", target], "umount leftover mount")


def discard_subvolume(path: Path) -> None:
    if not os.path.lexists(path):
        return
    unmount_under(path)
    if btrfs.is_subvolume(path):
        btrfs.delete_subvolume(path)
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
