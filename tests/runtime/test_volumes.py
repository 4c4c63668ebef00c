"""Integration tests of the node's btrfs storage layer (root + btrfs + loop devices + debootstrap cache).

Every filesystem these tests create lives under /var/tmp/space-test-<random> and is unmounted, detached
and removed at the end of the session, whatever happened in between.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.core.errors import AlreadyExists, InvalidArgument, NotFound
from space.node.volumes import (
    btrfs,
    btrfs_ioctl,
    btrfs_quota,
    btrfs_receive,
    sendstream,
    template_base,
    templates,
)
from space.node.volumes.filesystem import BtrfsFs, ensure_btrfs, mount_source, unmount_btrfs
from space.node.volumes.mirror import find_mirror

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop mounts, btrfs ioctls)"),
    pytest.mark.skipif(shutil.which("mkfs.btrfs") is None, reason="needs btrfs-progs"),
]

MB = 1 << 20


def _new_data_dir() -> Path:
    path = Path(f"/var/tmp/space-test-{secrets.token_hex(4)}")
    path.mkdir(mode=0o700)
    return path


def _cleanup(data_dir: Path) -> None:
    try:
        if data_dir.exists():
            unmount_btrfs(data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def node_fs() -> Iterator[BtrfsFs]:
    data_dir = _new_data_dir()
    try:
        yield ensure_btrfs(data_dir, image_size_gb=8)
    finally:
        _cleanup(data_dir)


@pytest.fixture(scope="session")
def other_node_fs() -> Iterator[BtrfsFs]:
    """A second, separate btrfs filesystem: another "node" for send/receive."""
    data_dir = _new_data_dir()
    try:
        yield ensure_btrfs(data_dir, image_size_gb=4)
    finally:
        _cleanup(data_dir)


@pytest.fixture(scope="session")
def template(node_fs: BtrfsFs) -> templates.Template:
    # First run on a machine: debootstrap (~1 min, cached in /var/cache/space/rootfs); after that ~1-2 s.
    return templates.ensure_template(node_fs.root)


@pytest.fixture
def work(node_fs: BtrfsFs) -> Iterator[Path]:
    """A fresh directory on the session filesystem for one test's subvolumes."""
    d = node_fs.root / "cache" / f"t-{secrets.token_hex(4)}"
    d.mkdir()
    yield d
    for entry in d.iterdir():
        if btrfs.is_subvolume(entry):
            btrfs.delete_subvolume(entry)
    shutil.rmtree(d, ignore_errors=True)


def _losetup_all() -> str:
    return subprocess.run(["losetup", "-a"], check=True, capture_output=True, text=True).stdout


def _write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for _ in range(size // MB):
            f.write(os.urandom(MB))
        f.flush()
        os.fsync(f.fileno())


# --- ioctl numbers ----------------------------------------------------------------------------------------
def test_ioctl_numbers_match_the_kernel_uapi() -> None:
    # Values from linux/btrfs.h as compiled on x86_64/arm64 (cross-checked with strace of btrfs-progs).
    assert btrfs_ioctl.BTRFS_IOC_SUBVOL_CREATE == 0x5000940E
    assert btrfs_ioctl.BTRFS_IOC_SNAP_DESTROY == 0x5000940F
    assert btrfs_ioctl.BTRFS_IOC_SNAP_CREATE_V2 == 0x50009417
    assert btrfs_ioctl.BTRFS_IOC_SNAP_DESTROY_V2 == 0x5000943F
    assert btrfs_ioctl.BTRFS_IOC_SUBVOL_GETFLAGS == 0x80089419
    assert btrfs_ioctl.BTRFS_IOC_SUBVOL_SETFLAGS == 0x4008941A
    assert btrfs_ioctl.BTRFS_IOC_SYNC == 0x9408
    assert btrfs_ioctl.BTRFS_IOC_TREE_SEARCH == 0xD0009411
    assert btrfs_ioctl.BTRFS_IOC_INO_LOOKUP == 0xD0009412
    assert btrfs_ioctl.BTRFS_IOC_QGROUP_LIMIT == 0x8030942B
    assert btrfs_ioctl.BTRFS_IOC_QUOTA_CTL == 0xC0109428


# --- filesystem -------------------------------------------------------------------------------------------
def test_ensure_btrfs_creates_layout_and_is_idempotent(node_fs: BtrfsFs) -> None:
    assert btrfs.is_btrfs(node_fs.root)
    assert node_fs.image is not None and node_fs.image.exists()
    assert node_fs.loop_device is not None and node_fs.loop_device.startswith("/dev/loop")
    for sub in ("templates", "sandboxes", "snapshots", "cache"):
        assert (node_fs.root / sub).is_dir()
    assert node_fs.quota in ("simple", "full")
    again = ensure_btrfs(node_fs.data_dir, image_size_gb=8)
    assert again == node_fs
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    assert len([line for line in mounts if str(node_fs.root) in line]) == 1


def test_unmount_leaves_no_loop_device_and_no_mount() -> None:
    data_dir = _new_data_dir()
    try:
        fs = ensure_btrfs(data_dir, image_size_gb=1)
        (fs.root / "cache" / "marker").write_text("kept")
        unmount_btrfs(data_dir)
        assert mount_source(fs.root) is None
        assert str(fs.root) not in Path("/proc/mounts").read_text()
        assert str(fs.image) not in _losetup_all()
        unmount_btrfs(data_dir)  # nothing mounted: a no-op
        # Image present but not mounted: mounted again, data still there.
        fs2 = ensure_btrfs(data_dir, image_size_gb=1)
        assert (fs2.root / "cache" / "marker").read_text() == "kept"
        unmount_btrfs(data_dir)
        assert str(fs.image) not in _losetup_all()
    finally:
        _cleanup(data_dir)
    assert not data_dir.exists()


def test_ensure_btrfs_discards_a_half_made_image() -> None:
    data_dir = _new_data_dir()
    try:
        (data_dir / "btrfs.img.tmp").write_bytes(b"killed during mkfs")
        fs = ensure_btrfs(data_dir, image_size_gb=1)
        assert btrfs.is_btrfs(fs.root)
        assert not (data_dir / "btrfs.img.tmp").exists()
    finally:
        _cleanup(data_dir)


# --- subvolumes and snapshots -----------------------------------------------------------------------------
def test_create_subvolume_and_inspect(work: Path) -> None:
    sv = btrfs.create_subvolume(work / "sv")
    assert btrfs.is_subvolume(sv)
    assert btrfs.subvolume_id(sv) >= 256
    plain = work / "plain"
    plain.mkdir()
    assert not btrfs.is_subvolume(plain)
    assert not btrfs.is_subvolume(work / "missing")
    assert not btrfs.is_btrfs("/proc")
    with pytest.raises(AlreadyExists):
        btrfs.create_subvolume(sv)
    with pytest.raises(NotFound):
        btrfs.create_subvolume(work / "no-parent" / "sv")
    with pytest.raises(InvalidArgument):
        btrfs.create_subvolume("/var/tmp/space-not-btrfs-" + secrets.token_hex(4))


def test_snapshot_is_writable_and_independent(work: Path) -> None:
    src = btrfs.create_subvolume(work / "src")
    (src / "a").write_text("one")
    snap = btrfs.snapshot(src, work / "snap")
    assert btrfs.is_subvolume(snap) and not btrfs.get_readonly(snap)
    (snap / "a").write_text("two")
    (snap / "b").write_text("new")
    assert (src / "a").read_text() == "one"
    assert not (src / "b").exists()
    with pytest.raises(NotFound):
        btrfs.snapshot(work / "missing", work / "x")
    with pytest.raises(AlreadyExists):
        btrfs.snapshot(src, snap)
    plain = work / "plain"
    plain.mkdir()
    with pytest.raises(InvalidArgument):
        btrfs.snapshot(plain, work / "y")


def test_readonly_snapshot_refuses_writes(work: Path) -> None:
    src = btrfs.create_subvolume(work / "src")
    (src / "f").write_text("data")
    ro = btrfs.snapshot(src, work / "ro", readonly=True)
    assert btrfs.get_readonly(ro)
    for attempt in (
        lambda: (ro / "new").write_text("x"),
        lambda: (ro / "f").write_text("changed"),
        (ro / "f").unlink,
        (ro / "d").mkdir,
    ):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    assert (ro / "f").read_text() == "data"
    btrfs.set_readonly(ro, False)
    (ro / "new").write_text("now allowed")
    btrfs.set_readonly(ro, True)
    btrfs.set_readonly(ro, True)  # idempotent
    assert btrfs.get_readonly(ro)


def test_delete_subvolume_with_data_and_nested_subvolumes(work: Path) -> None:
    sv = btrfs.create_subvolume(work / "sv")
    (sv / "dir" / "deep").mkdir(parents=True)
    (sv / "dir" / "deep" / "file").write_bytes(os.urandom(4096))
    inner = btrfs.create_subvolume(sv / "dir" / "inner")
    btrfs.create_subvolume(inner / "innermost")
    (inner / "x").write_text("x")
    btrfs.set_readonly(inner, True)  # a read-only subvolume holding a nested one
    btrfs.delete_subvolume(sv)
    assert not sv.exists()
    with pytest.raises(NotFound):
        btrfs.delete_subvolume(sv)
    plain = work / "plain"
    plain.mkdir()
    with pytest.raises(InvalidArgument):
        btrfs.delete_subvolume(plain)
    ro = btrfs.snapshot(btrfs.create_subvolume(work / "src"), work / "ro", readonly=True)
    btrfs.delete_subvolume(ro)
    assert not ro.exists()


# --- quotas -----------------------------------------------------------------------------------------------
def test_quota_limit_is_enforced(node_fs: BtrfsFs, work: Path) -> None:
    assert btrfs_quota.quota_enabled(node_fs.root)
    sv = btrfs.create_subvolume(work / "limited")
    btrfs_quota.set_limit(sv, 8 * MB)
    with pytest.raises(OSError) as info:
        _write_random(sv / "big", 32 * MB)
    assert info.value.errno in (errno.EDQUOT, errno.ENOSPC)
    # Lifting the limit lets writes through again.
    (sv / "big").unlink()
    btrfs.sync(sv)
    btrfs_quota.set_limit(sv, None)
    _write_random(sv / "big", 16 * MB)
    with pytest.raises(InvalidArgument):
        btrfs_quota.set_limit(sv, 0)


def test_exclusive_bytes_of_a_snapshot_count_only_its_own_writes(
    node_fs: BtrfsFs, template: templates.Template, work: Path
) -> None:
    snap = btrfs.snapshot(template.path, work / "rootfs")
    _write_random(snap / "ten", 10 * MB)
    usage = btrfs_quota.qgroup_usage(snap)
    assert 9 * MB <= usage.exclusive <= 11 * MB
    assert btrfs_quota.exclusive_bytes(snap) == usage.exclusive
    assert btrfs_quota.referenced_bytes(snap) >= usage.exclusive
    # The ioctl reader agrees with btrfs-progs.
    shown = btrfs_quota.qgroup_show(node_fs.root)
    assert shown[usage.qgroup] == (usage.referenced, usage.exclusive)


# --- send / receive ---------------------------------------------------------------------------------------
def test_send_delta_against_template_is_received_on_another_filesystem(
    node_fs: BtrfsFs, other_node_fs: BtrfsFs, template: templates.Template, work: Path, tmp_path: Path
) -> None:
    # Ship the template to the other node once, as a full stream.
    full = tmp_path / "template.stream"
    btrfs_receive.send(template.path, full)
    dest = other_node_fs.root / "templates"
    expected = sendstream.Expected.full(template.path.name)
    received_template = btrfs_receive.receive(full, dest, expected=expected)
    assert received_template == dest / template.path.name
    assert btrfs.get_readonly(received_template)

    # A sandbox writes 5 MB; its read-only disk snapshot travels as a delta against the template.
    rootfs = btrfs.snapshot(template.path, work / "rootfs")
    payload = os.urandom(5 * MB)
    (rootfs / "work" / "data.bin").write_bytes(payload)
    (rootfs / "etc" / "hostname").write_text("changed\n")
    snap = btrfs.snapshot(rootfs, work / "snap-1", readonly=True)
    delta = tmp_path / "snap-1.stream"
    with pytest.raises(InvalidArgument):
        btrfs_receive.send(rootfs, delta)  # writable: refused
    with open(delta, "wb") as f:  # an open file object works as well as a path
        btrfs_receive.send(snap, f, parent=template.path)
    assert 5 * MB <= delta.stat().st_size <= 7 * MB

    target = other_node_fs.root / "snapshots"
    parent = btrfs.subvolume_identity(template.path)
    expected = sendstream.Expected.delta("snap-1", {parent.received_uuid or parent.uuid})
    got = btrfs_receive.receive(delta, target, expected=expected)
    assert (got / "work" / "data.bin").read_bytes() == payload
    assert (got / "etc" / "hostname").read_text() == "changed\n"
    assert (got / "usr" / "bin" / "python3").exists()

    # Without the parent on the receiving side, the delta is refused.
    btrfs.delete_subvolume(got)
    btrfs.delete_subvolume(received_template)
    with pytest.raises(NotFound):
        btrfs_receive.receive(delta, target, expected=expected)
    for leftover in target.iterdir():
        if btrfs.is_subvolume(leftover):
            btrfs.delete_subvolume(leftover)


# --- templates --------------------------------------------------------------------------------------------
def _chroot_python(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["chroot", str(root), "/usr/bin/python3", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_template_is_a_readonly_python_rootfs_with_guest_code(template: templates.Template) -> None:
    t = template.path
    assert btrfs.is_subvolume(t) and btrfs.get_readonly(t)
    meta = json.loads((t.parent / "python.json").read_text())
    assert meta == template.metadata
    assert meta["name"] == "python" and meta["suite"] == "bookworm"
    assert meta["guest_code_hash"] == templates.guest_code_hash()
    assert meta["size_bytes"] > 50 * MB
    proc = _chroot_python(
        t, "-c", 'import sys; sys.path.insert(0, "/opt/space/lib"); import space.protocol; print("ok")'
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    # The exact interpreter flags of the init command work and use the precompiled code.
    argv = templates.guest_command()
    assert argv[0] == "/usr/bin/python3"
    flags = argv[1 : argv.index("-c")]
    proc = _chroot_python(
        t, *flags, "-c", "import sys; sys.path.insert(0, '/opt/space/lib'); import space.protocol"
    )
    assert proc.returncode == 0, proc.stderr
    assert list((t / "opt/space/lib/space/protocol/__pycache__").glob("*.cpython-311.pyc"))
    assert (t / "opt/space/lib/space/__init__.py").read_bytes() == b""
    # Neutral, non-root-friendly root filesystem.
    assert "user:x:1000:1000:" in (t / "etc/passwd").read_text()
    assert (t / "home/user").is_dir() and (t / "home/user").stat().st_uid == 1000
    assert ((t / "work").stat().st_mode & 0o777) == 0o777
    assert (t / "etc/resolv.conf").read_text() == ""
    assert (t / "etc/hostname").read_text() == "sandbox\n"
    assert (t / "usr/bin/ps").exists() and (t / "etc/ssl/certs").is_dir()
    assert not list((t / "var/cache/apt/archives").glob("*.deb"))


def test_ensure_template_is_idempotent_and_fast_when_cached(
    node_fs: BtrfsFs, template: templates.Template
) -> None:
    t0 = time.monotonic()
    again = templates.ensure_template(node_fs.root)
    assert time.monotonic() - t0 < 1.0
    assert again.metadata == template.metadata
    assert btrfs.subvolume_id(again.path) == template.metadata["subvolume_id"]


def test_guest_code_change_rebuilds_only_the_cheap_layer(
    node_fs: BtrfsFs, template: templates.Template, tmp_path: Path
) -> None:
    base = node_fs.templates / template_base.BASE_NAME
    base_id = btrfs.subvolume_id(base)
    src = tmp_path / "space"
    real = templates.default_guest_src()
    for sub in ("protocol", "guest"):
        if (real / sub).is_dir():
            shutil.copytree(real / sub, src / sub, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "guest").mkdir(exist_ok=True)
    (src / "guest" / "extra_marker.py").write_text("MARKER = 42\n")
    try:
        t0 = time.monotonic()
        changed = templates.ensure_template(node_fs.root, guest_src=src)
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0
        assert changed.metadata["guest_code_hash"] != template.metadata["guest_code_hash"]
        assert (changed.path / "opt/space/lib/space/guest/extra_marker.py").exists()
        assert btrfs.subvolume_id(base) == base_id  # the debootstrapped base was not touched
    finally:
        restored = templates.ensure_template(node_fs.root)
    assert restored.metadata["guest_code_hash"] == templates.guest_code_hash()
    assert not (restored.path / "opt/space/lib/space/guest/extra_marker.py").exists()


def test_half_built_layers_from_a_killed_run_are_rebuilt(node_fs: BtrfsFs) -> None:
    tdir = node_fs.templates
    # Killed while building the guest layer: staging subvolume present, metadata gone.
    btrfs.snapshot(tdir / template_base.BASE_NAME, tdir / ".python.new")
    (tdir / "python.json").unlink()
    rebuilt = templates.ensure_template(node_fs.root)
    assert (tdir / "python.json").exists() and not (tdir / ".python.new").exists()
    assert btrfs.get_readonly(rebuilt.path)
    # Killed while receiving the base: the marker (written last) is missing → base received again.
    (tdir / f"{template_base.BASE_NAME}.json").unlink()
    (tdir / "python.json").unlink()
    t0 = time.monotonic()
    again = templates.ensure_template(node_fs.root)
    assert time.monotonic() - t0 < 60
    assert (tdir / f"{template_base.BASE_NAME}.json").exists()
    proc = _chroot_python(again.path, "-c", "print(1)")
    assert proc.returncode == 0, proc.stderr


def test_unknown_template_name_is_invalid(node_fs: BtrfsFs) -> None:
    with pytest.raises(InvalidArgument):
        templates.ensure_template(node_fs.root, name="nope")


# --- mirror -----------------------------------------------------------------------------------------------
def test_find_mirror_reads_apt_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    assert find_mirror(tmp_path) == "http://mirror.example/debian"
    empty = tmp_path / "empty"
    (empty / "sources.list.d").mkdir(parents=True)
    with pytest.raises(NotFound):
        find_mirror(empty)
    assert find_mirror().startswith(("http://", "https://", "file:"))
