"""Least privilege on the host's files and mounts (issue 9, ADR 0022), on a real btrfs loop mount.

- The node's btrfs filesystem is mounted nosuid,nodev; a mount an older run made without them is remounted
  with them. A set-uid root binary on it does not raise a local user's privileges, and a device node on it
  cannot be opened, except inside `with_device_nodes` (debootstrap), which leaves no mount behind.
- What an older run left with default modes is tightened: the data directory of `space up`, its logs and
  secrets, the btrfs image, checkpoint images; root filesystems beside the images keep their modes.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

from space.controlplane.local import secure_data_dir
from space.node import filemodes
from space.node.volumes import filesystem

pytestmark = pytest.mark.root
BUSYBOX = shutil.which("busybox") or "/bin/busybox"
PYTHON = "/usr/bin/python3"
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def node_fs() -> Iterator[filesystem.BtrfsFs]:
    if os.geteuid() != 0:
        pytest.fail("mounting a btrfs image needs root: run the tests as root")
    # Under /var/tmp and 0755 so that `nobody` can reach the files the tests put there.
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-modes-", dir="/var/tmp"))
    data_dir.chmod(0o755)
    fs = filesystem.ensure_btrfs(data_dir, image_size_gb=1, quota=False)
    try:
        yield fs
    finally:
        filesystem.unmount_btrfs(data_dir)
        shutil.rmtree(data_dir)


def _options(root: pathlib.Path) -> set[str]:
    options = filesystem.mount_options(root)
    assert options is not None, f"{root} is not mounted"
    return options


def test_the_node_filesystem_is_mounted_nosuid_nodev_and_an_older_mount_is_remounted(
    node_fs: filesystem.BtrfsFs,
) -> None:
    assert {"nosuid", "nodev", "noatime"} <= _options(node_fs.root)
    assert node_fs.image is not None and stat.S_IMODE(node_fs.image.stat().st_mode) == 0o600
    # What an older SPACE left: the same mount without the two options, and an image with default modes.
    subprocess.run(["mount", "-o", "remount,suid,dev", str(node_fs.root)], check=True)
    node_fs.image.chmod(0o644)
    assert not {"nosuid", "nodev"} & _options(node_fs.root)
    again = filesystem.ensure_btrfs(node_fs.data_dir, image_size_gb=1, quota=False)
    assert again.root == node_fs.root
    assert {"nosuid", "nodev", "noatime"} <= _options(node_fs.root)
    assert stat.S_IMODE(node_fs.image.stat().st_mode) == 0o600
    stacked = [
        line for line in pathlib.Path("/proc/mounts").read_text().splitlines() if str(node_fs.root) in line
    ]
    assert len(stacked) == 1, stacked  # remounted in place, not mounted twice


def test_a_setuid_root_binary_on_the_node_filesystem_gives_a_local_user_nothing(
    node_fs: filesystem.BtrfsFs,
) -> None:
    exposed = node_fs.root / "exposed"  # as if a sandbox or a crafted stream had put it there
    exposed.mkdir(mode=0o755)
    node_fs.root.chmod(0o755)
    planted = exposed / "python3"  # (busybox drops set-uid privileges on its own: no use as a probe)
    shutil.copy(os.path.realpath(PYTHON), planted)
    os.chown(planted, 0, 0)
    planted.chmod(0o4755)
    euid = [*NOBODY, str(planted), "-I", "-S", "-c", "import os; print(os.geteuid())"]
    # Control: on the same filesystem mounted as an older run did (suid), `nobody` becomes root.
    subprocess.run(["mount", "-o", "remount,suid", str(node_fs.root)], check=True)
    assert subprocess.run(euid, capture_output=True, text=True, check=True).stdout.strip() == "0"
    filesystem.ensure_btrfs(node_fs.data_dir, image_size_gb=1, quota=False)
    ran = subprocess.run(euid, capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == str(pwd.getpwnam("nobody").pw_uid)


def test_device_nodes_work_only_inside_with_device_nodes_and_leave_no_mount(
    node_fs: filesystem.BtrfsFs,
) -> None:
    chroot = node_fs.root / "template-build"
    (chroot / "dev").mkdir(parents=True)
    shutil.copy(BUSYBOX, chroot / "busybox")
    os.mknod(chroot / "dev" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    write_null = ["chroot", str(chroot), "/busybox", "sh", "-c", "echo x > /dev/null && echo wrote"]
    denied = subprocess.run(write_null, capture_output=True, text=True, check=False)
    assert denied.returncode != 0 and "ermission denied" in denied.stderr, denied
    wrapped = filesystem.with_device_nodes(chroot, write_null)
    allowed = subprocess.run(wrapped, capture_output=True, text=True, check=False)
    assert allowed.returncode == 0 and allowed.stdout.strip() == "wrote", allowed
    # The bind mount lived in the command's own mount namespace only.
    assert filesystem.mount_source(chroot) is None
    assert {"nosuid", "nodev"} <= _options(node_fs.root)
    assert subprocess.run(write_null, capture_output=True, check=False).returncode != 0


def test_checkpoint_images_of_an_older_run_are_tightened_and_root_filesystems_are_not(
    tmp_path: pathlib.Path,
) -> None:
    root = tmp_path / "fs"
    image = root / "checkpoints" / "sb-a" / "snap-b"
    warm = root / "templates" / ".warm" / "python"
    guest_file = warm / "rootfs" / "etc" / "hosts"
    for directory in (image, warm / "image", guest_file.parent):
        directory.mkdir(parents=True)
    for path in (image / "pages.img", warm / "image" / "pages.img", warm / "config.json", guest_file):
        path.write_text("x")
        path.chmod(0o644)
    # The root filesystem's mode is set here, not left to the process umask (an earlier test may have
    # tightened it): what is checked is that restrict_images leaves it alone.
    for directory in (
        root / "checkpoints",
        image.parent,
        image,
        warm.parent,
        warm,
        warm / "image",
        warm / "rootfs",
    ):
        directory.chmod(0o755)
    filesystem.restrict_images(root)
    for path in (image / "pages.img", warm / "image" / "pages.img", warm / "config.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for directory in (root / "checkpoints", image.parent, image, warm.parent, warm, warm / "image"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE(guest_file.stat().st_mode) == 0o644  # the guest's files keep the guest's modes
    assert stat.S_IMODE((warm / "rootfs").stat().st_mode) == 0o755


def test_space_up_tightens_an_older_data_directory(tmp_path: pathlib.Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)
    older = ["admin.key", "controlplane.db", "controlplane.db-wal", "space.log", "helper.log", "btrfs.img"]
    for name in older:
        (data_dir / name).write_text("older run")
        (data_dir / name).chmod(0o644)
    (data_dir / "keys").mkdir(mode=0o755)
    (data_dir / "keys" / "org.key").write_text("k")
    (data_dir / "keys" / "org.key").chmod(0o644)
    outside = tmp_path / "outside"
    outside.write_text("not SPACE's")
    outside.chmod(0o644)
    (data_dir / "egress").mkdir(mode=0o700)
    (data_dir / "egress" / "link").symlink_to(outside)  # tightening never follows a link
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(data_dir / "helper.sock"))  # nor touches a socket
    os.chmod(data_dir / "helper.sock", 0o666)
    try:
        agent_gid = pwd.getpwnam("space").pw_gid
        secure_data_dir(data_dir, agent_gid)
        info = data_dir.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o710, 0, agent_gid)
        for name in older:
            assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name
        assert stat.S_IMODE((data_dir / "keys").stat().st_mode) == 0o700
        assert stat.S_IMODE((data_dir / "keys" / "org.key").stat().st_mode) == 0o600
        assert stat.S_IMODE(outside.stat().st_mode) == 0o644
        assert stat.S_IMODE(os.lstat(data_dir / "helper.sock").st_mode) == 0o666
        secure_data_dir(data_dir, 0)  # no agent user: the agent runs as root, nobody else is let in
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    finally:
        listener.close()


def test_private_logs_and_files_are_owner_only_whatever_existed(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "agent.log"
    log.write_text("older\n")
    log.chmod(0o644)
    fd = filemodes.open_private_log(log)
    try:
        os.write(fd, b"newer\n")
    finally:
        os.close(fd)
    assert log.read_text() == "older\nnewer\n" and stat.S_IMODE(log.stat().st_mode) == 0o600
    database = tmp_path / "controlplane.db"
    filemodes.create_private_file(database)
    assert stat.S_IMODE(database.stat().st_mode) == 0o600 and database.stat().st_size == 0
    link = tmp_path / "link.log"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        filemodes.open_private_log(link)  # a planted link is refused, not followed
    assert not (tmp_path / "elsewhere").exists()
