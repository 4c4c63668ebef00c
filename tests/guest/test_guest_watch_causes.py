"""files.watch refines two kinds with a `cause` (E2B's RENAME and CHMOD events come from it): the
`deleted` of a path renamed away is "renamed", a `modified` of metadata only is "attrib"; plain writes and
deletes carry no cause, so hosts that read only `kind` see what they saw before."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.guest.watch import PollWatcher
from space.protocol.frames import FrameType
from tests.support.guest_harness import Guest

Seen = set[tuple[str, str, str]]


@pytest.fixture(scope="module")
def inotify_guest() -> Iterator[Guest]:
    g = Guest(env={})
    yield g
    g.close()


def _changes_until(guest: Guest, stream: int, wanted: Seen, timeout: float = 5) -> Seen:
    seen: Seen = set()
    deadline = time.monotonic() + timeout
    while not wanted <= seen:
        frame = guest.next_frame(stream, timeout=max(0.01, deadline - time.monotonic()))
        assert frame.type == FrameType.EVENT, frame
        event = frame.json()
        assert event["type"] == "changes"
        for change in event["changes"]:
            assert set(change) <= {"path", "kind", "cause"}, change
            seen.add((change["path"], change["kind"], change.get("cause", "")))
    return seen


def test_rename_and_chmod_carry_their_cause(inotify_guest: Guest, tmp_path: Path) -> None:
    guest = inotify_guest
    old, new, other = tmp_path / "old.txt", tmp_path / "new.txt", tmp_path / "other.txt"
    old.write_bytes(b"1")
    other.write_bytes(b"2")
    stream = guest.open("files.watch", {"path": str(tmp_path)})
    assert guest.next_frame(stream).json() == {"type": "watching", "backend": "inotify"}
    old.rename(new)
    seen = _changes_until(guest, stream, {(str(old), "deleted", "renamed"), (str(new), "created", "")})
    os.chmod(other, 0o600)
    seen = _changes_until(guest, stream, {(str(other), "modified", "attrib")})
    assert (str(other), "modified", "") not in seen  # a chmod is not a write
    other.write_bytes(b"22")
    seen = _changes_until(guest, stream, {(str(other), "modified", "")})
    other.unlink()
    seen = _changes_until(guest, stream, {(str(other), "deleted", "")})
    assert (str(other), "deleted", "renamed") not in seen
    guest.cancel(stream)
    assert guest.collect(stream).result == {}


def test_poll_backend_sees_a_mode_change_as_attrib(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"x")
    # A mode of our own first: under an owner-only umask (left by a SPACE entry point an earlier fixture
    # ran in process) the file would already be 0600, and the chmod below no change at all.
    os.chmod(target, 0o644)
    watcher = PollWatcher(str(tmp_path), recursive=False)
    os.chmod(target, 0o600)
    assert watcher.changes(0.01) == [(str(target), "modified", "attrib")]
    target.write_bytes(b"longer")
    assert watcher.changes(0.01) == [(str(target), "modified", "")]
    watcher.close()
