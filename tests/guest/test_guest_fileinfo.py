"""spaced's file entries in detail: owner and group names, permissions strings, symlinks (dangling,
looping, pointing outside), listings by depth with their bounds, names that are not UTF-8, mkdir's
answer, rename with parents, and user extended attributes with their limits."""

from __future__ import annotations

import base64
import grp
import json
import os
import pwd
import stat
from pathlib import Path
from typing import Any

import pytest

from space.guest import fileinfo, xattrs
from tests.support.guest_harness import Guest


def code_of(guest: Guest, method: str, **params: Any) -> str:
    return str(guest.call(method, params).error["code"])


def listing(guest: Guest, **params: Any) -> tuple[list[dict[str, Any]], bool]:
    reply = guest.call("files.list", params)
    batches = [e["entries"] for e in reply.events if e["type"] == "entries"]
    entries = [entry for batch in [*batches, reply.result["entries"]] for entry in batch]
    return entries, reply.result["truncated"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_entry_names_owner_group_and_permissions(guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_bytes(b"abc")
    os.chmod(target, 0o640)
    info = guest.call("files.stat", {"path": str(target)}).result
    assert info["permissions"] == "-rw-r-----" and info["mode"] == 0o640 and info["type"] == "file"
    assert info["owner"] == pwd.getpwuid(os.getuid()).pw_name
    assert info["group"] == grp.getgrgid(os.getgid()).gr_name
    assert info["modified"].endswith("+00:00") and abs(info["mtime"] - target.stat().st_mtime) < 1e-3
    assert info["symlink_target"] is None and "path_b64" not in info
    directory = guest.call("files.stat", {"path": str(tmp_path)}).result
    assert directory["type"] == "dir" and directory["permissions"].startswith("d")


@pytest.mark.root
def test_unknown_uid_and_gid_have_no_names(guest: Guest, tmp_path: Path) -> None:
    orphan = tmp_path / "orphan"
    orphan.write_bytes(b"")
    os.chown(orphan, 54321, 54322)  # ids with no passwd/group entry
    info = guest.call("files.stat", {"path": str(orphan)}).result
    assert (info["uid"], info["gid"], info["owner"], info["group"]) == (54321, 54322, None, None)


def test_symlinks_dangling_looping_and_outside(guest: Guest, tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"12345")
    (tmp_path / "good").symlink_to("real")
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "loop_a").symlink_to("loop_b")
    (tmp_path / "loop_b").symlink_to("loop_a")
    (tmp_path / "escape").symlink_to("/../../../../etc/passwd")

    plain = guest.call("files.stat", {"path": str(tmp_path / "good")}).result
    assert plain["type"] == "symlink" and plain["symlink_target"] == "real" and plain["size"] == len("real")
    followed = guest.call("files.stat", {"path": str(tmp_path / "good"), "follow": True}).result
    assert followed["type"] == "file" and followed["size"] == 5 and followed["is_symlink"] is True
    assert followed["symlink_target"] == "real" and followed["symlink_resolved"] == str(tmp_path / "real")
    assert followed["path"] == str(tmp_path / "good") and followed["name"] == "good"
    for name, text in (("dangling", "nowhere"), ("loop_a", "loop_b")):
        broken = guest.call("files.stat", {"path": str(tmp_path / name), "follow": True}).result
        assert broken["type"] == "symlink" and broken["broken"] is True and broken["symlink_target"] == text
    # The answer names the link's text; following resolves inside the daemon's own root ("/.." is "/").
    escape = guest.call("files.stat", {"path": str(tmp_path / "escape"), "follow": True}).result
    assert (
        escape["symlink_target"] == "/../../../../etc/passwd" and escape["symlink_resolved"] == "/etc/passwd"
    )

    entries, truncated = listing(guest, path=str(tmp_path), depth=16)
    kinds = {e["name"]: (e["type"], e["symlink_target"]) for e in entries}
    assert not truncated and kinds == {
        "dangling": ("symlink", "nowhere"),
        "escape": ("symlink", "/../../../../etc/passwd"),
        "good": ("symlink", "real"),
        "loop_a": ("symlink", "loop_b"),
        "loop_b": ("symlink", "loop_a"),
        "real": ("file", None),
    }


def test_list_depth_order_and_bounds(guest: Guest, tmp_path: Path) -> None:
    (tmp_path / "b" / "b1" / "b11").mkdir(parents=True)
    (tmp_path / "b" / "b0.txt").write_bytes(b"")
    (tmp_path / "a.txt").write_bytes(b"")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "self").symlink_to("..")  # a walk never goes through a symlink
    rel = lambda entries: [os.path.relpath(e["path"], tmp_path) for e in entries]  # noqa: E731
    one, _ = listing(guest, path=str(tmp_path))
    assert rel(one) == ["a.txt", "b", "c"]
    two, _ = listing(guest, path=str(tmp_path), depth=2)
    assert rel(two) == ["a.txt", "b", "b/b0.txt", "b/b1", "c", "c/self"]
    deep, truncated = listing(guest, path=str(tmp_path), depth=16)
    assert rel(deep) == ["a.txt", "b", "b/b0.txt", "b/b1", "b/b1/b11", "c", "c/self"] and not truncated
    cut, truncated = listing(guest, path=str(tmp_path), depth=16, limit=3)
    assert rel(cut) == ["a.txt", "b", "b/b0.txt"] and truncated
    exact, truncated = listing(guest, path=str(tmp_path), limit=3)
    assert rel(exact) == ["a.txt", "b", "c"] and not truncated
    for bad in ({"depth": 0}, {"depth": 17}, {"depth": True}, {"limit": 0}, {"limit": 50_001}):
        assert code_of(guest, "files.list", path=str(tmp_path), **bad) == "invalid_argument"


def test_deep_tree_is_bounded_by_depth(guest: Guest, tmp_path: Path) -> None:
    path = tmp_path
    for level in range(40):
        path = path / f"d{level}"
    path.mkdir(parents=True)
    entries, truncated = listing(guest, path=str(tmp_path), depth=fileinfo.MAX_DEPTH)
    assert len(entries) == fileinfo.MAX_DEPTH and not truncated


def test_wide_tree_is_bounded_by_the_entry_cap(guest: Guest, tmp_path: Path) -> None:
    for top in range(12):
        sub = tmp_path / f"t{top:02d}"
        sub.mkdir()
        for index in range(50):
            (sub / f"f{index:03d}").touch()
    entries, truncated = listing(guest, path=str(tmp_path), depth=2, limit=400)
    assert len(entries) == 400 and truncated
    names = [os.path.relpath(e["path"], tmp_path) for e in entries]
    assert names[:2] == ["t00", "t00/f000"] and names == sorted(names)


def test_names_that_are_not_utf8(guest: Guest, tmp_path: Path) -> None:
    raw = os.fsencode(str(tmp_path)) + b"/caf\xe9-\xff"
    with open(raw, "wb") as f:
        f.write(b"x")
    entries, _ = listing(guest, path=str(tmp_path))
    (only,) = entries
    assert only["name"] == "caf\ufffd-\ufffd" and base64.b64decode(only["path_b64"]) == raw
    assert only["path"].encode("utf-8")  # valid UTF-8 on the wire


def test_mkdir_answers_created_and_rename_makes_parents(guest: Guest, tmp_path: Path) -> None:
    made = guest.call("files.mkdir", {"path": str(tmp_path / "new")}).result
    assert made["created"] is True and made["entry"]["permissions"] == "drwxr-xr-x"
    assert guest.call("files.mkdir", {"path": str(tmp_path / "new")}).result["created"] is False
    assert code_of(guest, "files.mkdir", path=str(tmp_path / "new"), parents=False) == "already_exists"
    (tmp_path / "src.txt").write_bytes(b"data")
    dst = tmp_path / "x" / "y" / "dst.txt"
    assert code_of(guest, "files.rename", src=str(tmp_path / "src.txt"), dst=str(dst)) == "not_found"
    moved = guest.call("files.rename", {"src": str(tmp_path / "src.txt"), "dst": str(dst), "parents": True})
    assert moved.result["entry"]["path"] == str(dst) and moved.result["entry"]["size"] == 4
    assert dst.read_bytes() == b"data"


def _xattrs_supported(path: Path) -> bool:
    try:
        os.setxattr(path, "user.probe", b"1")
    except OSError:
        return False
    os.removexattr(path, "user.probe")
    return True


def test_xattrs_round_trip_and_limits(guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "tagged"
    target.write_bytes(b"")
    if not _xattrs_supported(target):
        # The host's test directory cannot hold them: the daemon must say so with a typed error.
        assert code_of(guest, "files.xattr_set", path=str(target), name="user.k", value_b64=b64(b"v")) == (
            "not_supported"
        )
        return
    p = str(target)
    assert guest.call(
        "files.xattr_set", {"path": p, "name": "user.e2b.owner", "value_b64": b64(b"\x00bin")}
    ).ok
    assert guest.call("files.xattr_get", {"path": p, "name": "user.e2b.owner"}).result == {
        "name": "user.e2b.owner",
        "value_b64": b64(b"\x00bin"),
    }
    assert guest.call("files.xattr_list", {"path": p}).result == {
        "xattrs": {"user.e2b.owner": b64(b"\x00bin")}
    }
    info = guest.call("files.stat", {"path": p, "xattrs": True}).result
    assert info["xattrs"] == {"user.e2b.owner": b64(b"\x00bin")}
    entries, _ = listing(guest, path=str(tmp_path), xattrs=True)
    assert entries[0]["xattrs"] == {"user.e2b.owner": b64(b"\x00bin")}
    assert guest.call("files.xattr_remove", {"path": p, "name": "user.e2b.owner"}).ok
    assert code_of(guest, "files.xattr_get", path=p, name="user.e2b.owner") == "not_found"
    assert code_of(guest, "files.xattr_remove", path=p, name="user.e2b.owner") == "not_found"
    assert guest.call("files.xattr_list", {"path": p}).result == {"xattrs": {}}


def test_xattr_attacks(guest: Guest, tmp_path: Path) -> None:
    target = tmp_path / "t"
    target.write_bytes(b"")
    p = str(target)
    for name in ("trusted.x", "security.capability", "system.posix_acl_access", "user.", "USER.x", "x"):
        assert code_of(guest, "files.xattr_set", path=p, name=name, value_b64=b64(b"v")) == "invalid_argument"
        assert code_of(guest, "files.xattr_get", path=p, name=name) == "invalid_argument"
        assert code_of(guest, "files.xattr_remove", path=p, name=name) == "invalid_argument"
    long_name = "user." + "n" * 251
    assert code_of(guest, "files.xattr_get", path=p, name=long_name) == "invalid_argument"
    assert code_of(guest, "files.xattr_get", path=p, name="user.a\x00b") == "invalid_argument"
    huge = b64(b"v" * (xattrs.MAX_VALUE_BYTES + 1))
    assert code_of(guest, "files.xattr_set", path=p, name="user.big", value_b64=huge) == "invalid_argument"
    bomb = "A" * (900 << 10)  # far beyond any value (near a frame's limit): refused before decoding
    assert code_of(guest, "files.xattr_set", path=p, name="user.big", value_b64=bomb) == "invalid_argument"
    assert (
        code_of(guest, "files.xattr_set", path=p, name="user.k", value_b64="not base64!")
        == "invalid_argument"
    )
    assert code_of(guest, "files.xattr_list", path=str(tmp_path / "missing")) == "not_found"
    assert stat.S_ISREG(target.lstat().st_mode)


def test_attributes_beyond_a_frame_are_refused_and_listings_go_on(guest: Guest) -> None:
    shm = Path("/dev/shm")  # tmpfs: values of 64 KiB (ext4 keeps one block per inode)
    directory = shm / f"space-xattr-{os.getpid()}"
    directory.mkdir()
    try:
        heavy = directory / "heavy"
        heavy.write_bytes(b"")
        for index in range(5):  # 320 KiB of values, beyond MAX_LISTED_BYTES
            os.setxattr(heavy, f"user.k{index}", b"v" * xattrs.MAX_VALUE_BYTES)
        (directory / "light").write_bytes(b"")
        assert code_of(guest, "files.xattr_list", path=str(heavy)) == "invalid_argument"
        value = guest.call("files.xattr_get", {"path": str(heavy), "name": "user.k4"}).result["value_b64"]
        assert base64.b64decode(value) == b"v" * xattrs.MAX_VALUE_BYTES
        entries, _ = listing(guest, path=str(directory), xattrs=True)
        assert [(e["name"], e["xattrs"]) for e in entries] == [("heavy", None), ("light", {})]
        assert guest.call("files.stat", {"path": str(heavy), "xattrs": True}).result["xattrs"] is None
    finally:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()


def test_the_batch_size_bound_is_an_upper_bound(tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_bytes(b"x")
    (tmp_path / "link").symlink_to("é" * 50 + "/\U0001f600")
    with open(os.fsencode(str(tmp_path)) + b"/" + b"\xff\xfe" * 40, "wb"):
        pass
    (tmp_path / ("ü" * 120)).mkdir()
    names = fileinfo.Names()
    entries = [*fileinfo.walk(str(tmp_path), 2, names)]
    entries.append(fileinfo.describe(str(tmp_path / "link"), names, follow=True))
    entries.append(fileinfo.entry("/x", os.stat("/"), names) | {"xattrs": {"user.é": "QUJD" * 100}})
    assert len(entries) == 6
    for item in entries:
        assert fileinfo.json_size_bound(item) >= len(json.dumps(item)), item
