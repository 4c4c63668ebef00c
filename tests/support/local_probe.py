"""What a local user can read: run as that user (`setpriv ... python3 -I local_probe.py`); stdlib only.

Input (stdin, one JSON object, so that no secret ever appears in a command line):
  needles: {name: secret}; roots: directories to walk (listing each directory it can); paths: more files
  or directories to try by name (what a user who guesses names would try); pids: processes whose
  /proc/<pid>/environ and cmdline are read.
Output (stdout, one JSON object): found [[needle name, where]], listed (directories it could list),
  unlistable (directories it could not), readable (files it could open), too_large (readable files it did
  not scan because of their size: each is a finding of its own), environ_read (pids whose environment it
  could read). Secret values are never printed, only their names.
"""

from __future__ import annotations

import json
import os
import stat
import sys

CHUNK = 1 << 20
MAX_SCAN = 1 << 30  # the template cache is ~170 MB; the sparse btrfs image is 64 GiB


class Probe:
    def __init__(self, needles: dict[str, str]) -> None:
        self.needles = {name: value.encode() for name, value in needles.items() if value}
        self.overlap = max((len(v) for v in self.needles.values()), default=1)
        self.found: list[list[str]] = []
        self.listed: list[str] = []
        self.unlistable: list[str] = []
        self.readable: list[str] = []
        self.too_large: list[str] = []
        self.environ_read: list[int] = []
        self.seen: set[tuple[int, int]] = set()

    def search(self, data: bytes, where: str) -> None:
        for name, value in self.needles.items():
            if value in data and [name, where] not in self.found:
                self.found.append([name, where])

    def scan_file(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return
            self.readable.append(path)
            if info.st_size > MAX_SCAN:
                self.too_large.append(path)
                return
            tail = b""
            while True:
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    break
                self.search(tail + chunk, path)
                tail = chunk[-self.overlap :]
        except OSError:
            return
        finally:
            os.close(fd)

    def walk(self, path: str) -> None:
        try:
            info = os.lstat(path)
        except OSError:
            return
        if (info.st_dev, info.st_ino) in self.seen:
            return
        self.seen.add((info.st_dev, info.st_ino))
        if stat.S_ISREG(info.st_mode):
            self.scan_file(path)
            return
        if not stat.S_ISDIR(info.st_mode):
            return
        try:
            names = os.listdir(path)
        except OSError:
            self.unlistable.append(path)
            return
        self.listed.append(path)
        for name in names:
            self.walk(os.path.join(path, name))

    def process(self, pid: int) -> None:
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as handle:
                    data = handle.read()
            except OSError:
                continue
            if part == "environ":
                self.environ_read.append(pid)
            self.search(data, f"/proc/{pid}/{part}")


def main() -> int:
    request = json.load(sys.stdin)
    probe = Probe(request["needles"])
    for root in request.get("roots", []):
        probe.walk(root)
    for path in request.get("paths", []):
        probe.walk(path)
    for pid in request.get("pids", []):
        probe.process(int(pid))
    json.dump(
        {
            "uid": os.getuid(),
            "found": probe.found,
            "listed": probe.listed,
            "unlistable": probe.unlistable,
            "readable": probe.readable,
            "too_large": probe.too_large,
            "environ_read": probe.environ_read,
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
