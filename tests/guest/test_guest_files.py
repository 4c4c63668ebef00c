"""spaced's file calls: streamed read/write (a large file in bounded memory), metadata calls, their
error codes, and watch with both backends."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.guest.watch import PollWatcher
from space.protocol.frames import Channel, FrameType
from tests.support.guest_harness import Guest


def vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def code_of(guest: Guest, method: str, **params: Any) -> str:
    return str(guest.call(method, params).error["code"])


# --- read / write -----------------------------------------------------------------------------------------


def test_write_read_round_trip(guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "sub" / "dir" / "a.bin"
    data = os.urandom(700_000)
    assert guest.call("files.write", {"path": str(target)}, body=data).result == {"size": len(data)}
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    reply = guest.call("files.read", {"path": str(target)})
    assert reply.body == data and reply.result == {"size": len(data), "read": len(data)}
    part = guest.call("files.read", {"path": str(target), "offset": 10, "length": 300_000})
    assert part.body == data[10:300_010] and part.result["read"] == 300_000
    assert [name for name in os.listdir(target.parent) if name.endswith(".tmp")] == []


def test_write_mode_append_and_overwrite_keeps_mode(guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "script.sh"
    assert guest.call("files.write", {"path": str(target), "mode": 0o750}, body=b"#!/bin/sh\n").ok
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert guest.call("files.write", {"path": str(target), "append": True}, body=b"echo hi\n").result == {
        "size": 18
    }
    assert target.read_bytes() == b"#!/bin/sh\necho hi\n"
    assert guest.call("files.write", {"path": str(target)}, body=b"new").ok
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o750
    empty = tmp_path / "empty"
    assert guest.call("files.write", {"path": str(empty)}, body=b"").result == {"size": 0}
    assert empty.read_bytes() == b""


def test_write_through_symlink(guest: Guest, tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"old")
    (tmp_path / "link").symlink_to("real")
    assert guest.call("files.write", {"path": str(tmp_path / "link")}, body=b"via link").ok
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real").read_bytes() == b"via link"


def test_cancelled_write_leaves_target_untouched(guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "keep.txt"
    target.write_bytes(b"original")
    stream = guest.open("files.write", {"path": str(target)})
    guest.send_body(stream, b"partial" * 1000, eof=False)
    time.sleep(0.05)
    guest.cancel(stream)
    assert guest.collect(stream).error["code"] == "cancelled"
    assert target.read_bytes() == b"original"
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]


def test_read_write_errors(guest: Guest, tmp_path: Path) -> None:
    assert code_of(guest, "files.read", path=str(tmp_path / "missing")) == "not_found"
    assert code_of(guest, "files.read", path=str(tmp_path)) == "is_a_directory"
    assert guest.call("files.write", {"path": str(tmp_path)}, body=b"x").error["code"] == "is_a_directory"
    no_parents = {"path": str(tmp_path / "nope" / "f"), "parents": False}
    assert guest.call("files.write", no_parents, body=b"x").error["code"] == "not_found"
    (tmp_path / "file").write_bytes(b"")
    under_file = {"path": str(tmp_path / "file" / "child")}
    assert guest.call("files.write", under_file, body=b"x").error["code"] in (
        "already_exists",
        "not_a_directory",
    )
    assert code_of(guest, "files.read", path="") == "invalid_argument"
    assert code_of(guest, "files.read", path=str(tmp_path / "file"), offset=-1) == "invalid_argument"


@pytest.mark.skipif(not os.path.isdir("/work"), reason="relative paths resolve against /work")
@pytest.mark.root  # writes under the host's /work, which only root may write
def test_relative_paths_resolve_against_work(guest: Guest) -> None:
    name = f"spaced-test-{os.getpid()}"
    try:
        assert guest.call("files.write", {"path": f"{name}/rel.txt"}, body=b"rel").ok
        assert Path("/work", name, "rel.txt").read_bytes() == b"rel"
        assert guest.call("files.stat", {"path": f"{name}/rel.txt"}).result["path"] == f"/work/{name}/rel.txt"
    finally:
        assert guest.call("files.remove", {"path": name, "recursive": True}).ok


def test_large_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    g = Guest()
    try:
        target = tmp_path / "big.bin"
        block = os.urandom(1 << 20)
        blocks = 200
        expected = hashlib.sha256()
        stream = g.open("files.write", {"path": str(target)})
        for _ in range(blocks):
            g.send_body(stream, block, eof=False)
            expected.update(block)
        g.send_body(stream, b"", eof=True)
        assert g.collect(stream, timeout=60).result == {"size": blocks << 20}

        got = hashlib.sha256()
        reply = g.collect(
            g.open("files.read", {"path": str(target)}),
            timeout=60,
            keep_data=False,
            on_data=lambda _channel, data: got.update(data),
        )
        assert reply.result["size"] == blocks << 20
        assert got.hexdigest() == expected.hexdigest()
        assert vm_hwm_kib(g.pid) < 64 * 1024, f"daemon peak RSS {vm_hwm_kib(g.pid)} KiB"
    finally:
        g.close()


# --- metadata ---------------------------------------------------------------------------------------------


def test_list_and_stat(guest: Guest, tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"12345")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "c_link").symlink_to("b.txt")
    entries = guest.call("files.list", {"path": str(tmp_path)}).result["entries"]
    assert [(e["name"], e["type"]) for e in entries] == [
        ("a_dir", "dir"),
        ("b.txt", "file"),
        ("c_link", "symlink"),
    ]
    by_name = {e["name"]: e for e in entries}
    assert by_name["b.txt"]["size"] == 5 and by_name["b.txt"]["path"] == str(tmp_path / "b.txt")
    assert by_name["c_link"]["target"] == "b.txt"
    info = guest.call("files.stat", {"path": str(tmp_path / "c_link")}).result
    assert info["type"] == "symlink" and info["target"] == "b.txt"
    info = guest.call("files.stat", {"path": str(tmp_path / "b.txt")}).result
    assert set(info) == {
        "name", "path", "type", "size", "mode", "permissions", "mtime", "modified", "uid", "gid", "owner",
        "group", "target", "symlink_target",
    }  # fmt: skip
    assert info["mode"] == stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) and info["uid"] == os.getuid()
    assert code_of(guest, "files.list", path=str(tmp_path / "b.txt")) == "not_a_directory"
    assert code_of(guest, "files.list", path=str(tmp_path / "missing")) == "not_found"
    assert code_of(guest, "files.stat", path=str(tmp_path / "missing")) == "not_found"


def test_list_of_a_huge_directory_is_batched(guest: Guest, tmp_path: Path) -> None:
    for index in range(6000):
        (tmp_path / f"file-with-a-rather-long-name-{index:05d}").touch()
    reply = guest.call("files.list", {"path": str(tmp_path)})
    batches = [event["entries"] for event in reply.events if event["type"] == "entries"]
    assert batches, "expected EVENT batches for a listing bigger than a frame"
    names = [e["name"] for batch in [*batches, reply.result["entries"]] for e in batch]
    assert len(names) == 6000 and names == sorted(names)


def test_mkdir(guest: Guest, tmp_path: Path) -> None:
    deep = tmp_path / "x" / "y" / "z"
    made = guest.call("files.mkdir", {"path": str(deep), "mode": 0o700}).result
    assert made["created"] is True and made["entry"]["type"] == "dir" and made["entry"]["path"] == str(deep)
    assert deep.is_dir() and stat.S_IMODE(deep.stat().st_mode) == 0o700
    again = guest.call("files.mkdir", {"path": str(deep)}).result  # -p: existing is fine, and said so
    assert again["created"] is False and again["entry"]["permissions"] == "drwx------"
    assert code_of(guest, "files.mkdir", path=str(deep), parents=False) == "already_exists"
    assert code_of(guest, "files.mkdir", path=str(tmp_path / "p" / "q"), parents=False) == "not_found"
    (tmp_path / "f").write_bytes(b"")
    assert code_of(guest, "files.mkdir", path=str(tmp_path / "f")) == "already_exists"


def test_remove(guest: Guest, tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(b"")
    (tmp_path / "g").write_bytes(b"")
    assert code_of(guest, "files.remove", path=str(tmp_path / "d")) == "not_empty"
    assert guest.call("files.remove", {"path": str(tmp_path / "d"), "recursive": True}).ok
    assert guest.call("files.remove", {"path": str(tmp_path / "g")}).ok
    assert os.listdir(tmp_path) == []
    assert code_of(guest, "files.remove", path=str(tmp_path / "g")) == "not_found"
    assert code_of(guest, "files.remove", path="/", recursive=True) == "permission_denied"


def test_rename_and_chmod(guest: Guest, tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    assert guest.call("files.rename", {"src": str(tmp_path / "a"), "dst": str(tmp_path / "b")}).ok
    assert (tmp_path / "b").read_bytes() == b"x" and not (tmp_path / "a").exists()
    assert code_of(guest, "files.rename", src=str(tmp_path / "a"), dst=str(tmp_path / "c")) == "not_found"
    assert guest.call("files.chmod", {"path": str(tmp_path / "b"), "mode": 0o600}).ok
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600
    assert code_of(guest, "files.chmod", path=str(tmp_path / "nope"), mode=0o600) == "not_found"
    assert code_of(guest, "files.chmod", path=str(tmp_path / "b"), mode=0o70000) == "invalid_argument"
    assert code_of(guest, "files.chmod", path=str(tmp_path / "b")) == "invalid_argument"


# --- watch ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["inotify", "poll"])
def watch_guest(request: pytest.FixtureRequest) -> Iterator[tuple[Guest, str]]:
    env = {"SPACED_WATCH_POLL": "1"} if request.param == "poll" else {}
    g = Guest(env=env)
    yield g, request.param
    g.close()


def wait_for_changes(guest: Guest, stream: int, wanted: set[tuple[str, str]], timeout: float = 5) -> None:
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + timeout
    while not wanted <= seen:
        frame = guest.next_frame(stream, timeout=max(0.01, deadline - time.monotonic()))
        assert frame.type == FrameType.EVENT, frame
        event = frame.json()
        assert event["type"] == "changes"
        seen |= {(c["path"], c["kind"]) for c in event["changes"]}


def test_watch_create_modify_delete(watch_guest: tuple[Guest, str], tmp_path: Path) -> None:
    guest, backend = watch_guest
    stream = guest.open("files.watch", {"path": str(tmp_path)})
    ready = guest.next_frame(stream).json()
    assert ready == {"type": "watching", "backend": backend}
    target = tmp_path / "w.txt"
    target.write_bytes(b"1")
    wait_for_changes(guest, stream, {(str(target), "created")})
    time.sleep(0.05)
    target.write_bytes(b"22")
    wait_for_changes(guest, stream, {(str(target), "modified")})
    target.unlink()
    wait_for_changes(guest, stream, {(str(target), "deleted")})
    guest.cancel(stream)
    reply = guest.collect(stream)
    assert reply.result == {}


def test_watch_recursive(watch_guest: tuple[Guest, str], tmp_path: Path) -> None:
    guest, _backend = watch_guest
    stream = guest.open("files.watch", {"path": str(tmp_path), "recursive": True})
    assert guest.next_frame(stream).json()["type"] == "watching"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.txt").write_bytes(b"x")
    wait_for_changes(
        guest, stream, {(str(tmp_path / "sub"), "created"), (str(tmp_path / "sub" / "inner.txt"), "created")}
    )
    time.sleep(0.3)
    (tmp_path / "sub" / "later.txt").write_bytes(b"y")
    wait_for_changes(guest, stream, {(str(tmp_path / "sub" / "later.txt"), "created")})
    guest.cancel(stream)
    assert guest.collect(stream).ok


def test_watch_missing_path(guest: Guest, tmp_path: Path) -> None:
    assert code_of(guest, "files.watch", path=str(tmp_path / "missing")) == "not_found"


def test_poll_watcher_directly(tmp_path: Path) -> None:
    watcher = PollWatcher(str(tmp_path), recursive=False)
    (tmp_path / "n").write_bytes(b"")
    assert (str(tmp_path / "n"), "created", "") in watcher.changes(0.01)
    (tmp_path / "n").unlink()
    assert watcher.changes(0.01) == [(str(tmp_path / "n"), "deleted", "")]
    watcher.close()


def test_body_channel_checked(guest: Guest, tmp_path: Path) -> None:
    stream = guest.open("files.write", {"path": str(tmp_path / "f")})
    from space.protocol.frames import encode, encode_data

    guest.write_raw(encode_data(stream, Channel.STDOUT, b"wrong channel"))
    assert guest.collect(stream).error["code"] == "invalid_argument"
    assert not (tmp_path / "f").exists()
    stream = guest.open("files.write", {"path": str(tmp_path / "g")})
    guest.write_raw(encode(FrameType.EOF, stream))  # an EOF without its channel byte
    assert guest.collect(stream).error["code"] == "malformed_payload"
    assert os.listdir(tmp_path) == []


def test_write_to_a_device_writes_in_place(guest: Guest) -> None:
    assert guest.call("files.write", {"path": "/dev/null"}, body=b"discarded").result == {"size": 9}
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
