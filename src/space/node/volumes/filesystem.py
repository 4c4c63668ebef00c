"""The node's data-directory filesystem: a btrfs root for templates, sandbox root filesystems and snapshots.

Invariants:
- `ensure_btrfs(data_dir)` always returns a btrfs directory `<data_dir>/fs` (the "btrfs root"):
  * if `data_dir` is already on btrfs, `<data_dir>/fs` is a subvolume of that filesystem;
  * otherwise `<data_dir>/btrfs.img` (sparse) is loop-mounted on `<data_dir>/fs`.
  It is idempotent: mounted → reused; image present but not mounted → mounted; nothing → created.
- `btrfs.img` exists only once it holds a complete filesystem: it is made as `btrfs.img.tmp`, formatted, and
  renamed, so a run killed halfway leaves at most a `.tmp` that the next run discards.
- The loop device is attached by `mount -o loop`, which sets LO_FLAGS_AUTOCLEAR: unmounting detaches it.
  `unmount_btrfs` still checks `losetup -j` and detaches leftovers, so it leaves no mount and no loop device.
- Layout under the root (created by `ensure_layout`): templates/, sandboxes/<id>/rootfs (writable snapshot),
  snapshots/<sandbox>/<snapshot id> (read-only), cache/.
- Concurrent callers on one data dir are serialized by an flock on `<data_dir>/.btrfs.lock`.
- The loop mount is `nosuid,nodev` (ADR 0022): a set-uid file or a device node that a sandbox, a template or
  a crafted stream puts on the filesystem means nothing to the host. A mount from an older run without
  them is remounted with them. Building a template base, which needs working device nodes inside its
  chroot, gets them on a bind mount of that one directory in a private mount namespace
  (`with_device_nodes`).
- The image is 0600, checkpoint images (`checkpoints/`, `templates/.warm/`) are root's only (directories
  0700, files 0600), whatever an older run left: they hold every sandbox's files and memory.
- Commands run as argv lists (never a shell); failures become RuntimeFailure/InvalidArgument `from` the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from space.core.errors import InvalidArgument, NotFound, RuntimeFailure
from space.node.volumes import btrfs, btrfs_quota

IMAGE_NAME = "btrfs.img"
MOUNT_NAME = "fs"
LAYOUT = ("templates", "sandboxes", "snapshots", "cache")
DEFAULT_IMAGE_SIZE_GB = 64
# noatime: reads must not dirty metadata, or every read in a sandbox would un-share metadata blocks with
# its template and grow snapshot deltas. nosuid,nodev: see the module invariants.
MOUNT_OPTIONS = "loop,noatime,nosuid,nodev"
HARDENING_OPTIONS = ("nosuid", "nodev")


@dataclass(frozen=True)
class BtrfsFs:
    data_dir: Path
    root: Path  # the btrfs root: <data_dir>/fs
    image: Path | None  # the loop image, or None when data_dir was already on btrfs
    loop_device: str | None  # e.g. /dev/loop3 while mounted from the image
    quota: str | None = None  # "simple" / "full" quota mode in force, None if quotas are off

    @property
    def templates(self) -> Path:
        return self.root / "templates"

    @property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def cache(self) -> Path:
        return self.root / "cache"


def _run(argv: list[str], what: str) -> str:
    try:
        proc = subprocess.run(argv, check=True, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise RuntimeFailure(f"{what}: {argv[0]} is not installed") from exc
    except subprocess.CalledProcessError as exc:
        raise RuntimeFailure(f"{what} failed: {(exc.stderr or '').strip()}", argv=argv) from exc
    return proc.stdout


def _unescape_mount_field(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal (\040 ...).
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_source(mountpoint: Path) -> tuple[str, str] | None:
    """(source, fstype) of the topmost mount exactly at `mountpoint`, or None if nothing is mounted there."""
    target = os.path.realpath(mountpoint)
    found: tuple[str, str] | None = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and _unescape_mount_field(parts[1]) == target:
                found = (_unescape_mount_field(parts[0]), parts[2])  # later lines are mounted on top
    return found


def mount_options(mountpoint: Path) -> set[str] | None:
    """The options of the topmost mount exactly at `mountpoint` (None if nothing is mounted there)."""
    target = os.path.realpath(mountpoint)
    found: set[str] | None = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and _unescape_mount_field(parts[1]) == target:
                found = set(parts[3].split(","))
    return found


def _harden_mount(root: Path) -> None:
    """Remount `root` (a mount SPACE made) with nosuid,nodev if an older run mounted it without them."""
    options = mount_options(root) or set()
    if not set(HARDENING_OPTIONS) <= options:
        _run(["mount", "-o", "remount," + ",".join(HARDENING_OPTIONS), str(root)], "remount nosuid,nodev")


def with_device_nodes(directory: Path, argv: list[str]) -> list[str]:
    """`argv`, run so that device nodes in `directory` work (debootstrap makes /dev/null & co. in its
    target, and its chroot scripts use them): in a private mount namespace of its own, where `directory` is
    bind-mounted on itself with `dev`. Nothing of that is visible outside, and it all goes with the process;
    the node's filesystem stays `nodev` for everyone else."""
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,dev,nosuid "$1" && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "space-devices",
            os.fspath(directory), *argv]  # fmt: skip


def restrict_images(root: Path) -> None:
    """Checkpoint images under the btrfs root: directories 0700, files 0600 (see the module invariants).

    Only the image directories themselves (`checkpoints/<sandbox>/<snapshot>/*`, `templates/.warm/<name>/`
    and its `image/`), never a root filesystem beside them: those files are the guest's, with its modes."""
    checkpoints = root / "checkpoints"
    images = [checkpoints, *_subdirs(checkpoints)]
    images += [snap for sandbox in _subdirs(checkpoints) for snap in _subdirs(sandbox)]
    warm = root / "templates" / ".warm"
    images += [warm, *_subdirs(warm), *(w / "image" for w in _subdirs(warm))]
    for directory in images:
        if directory.is_symlink() or not directory.is_dir():
            continue
        _owner_only(directory)
        for entry in directory.iterdir():
            if not entry.is_symlink() and entry.is_file():
                _owner_only(entry)


def _subdirs(directory: Path) -> list[Path]:
    if directory.is_symlink() or not directory.is_dir():
        return []
    return [d for d in directory.iterdir() if not d.is_symlink() and d.is_dir()]


def _owner_only(path: Path) -> None:
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode & 0o077:
        os.chmod(path, mode & 0o700)


def loop_devices_for(image: Path) -> list[str]:
    """Loop devices currently backed by `image` (`losetup -j`)."""
    if not image.exists():
        return []
    out = _run(["losetup", "-n", "-O", "NAME", "-j", str(image)], "losetup -j")
    return [line.strip() for line in out.splitlines() if line.strip()]


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    with open(data_dir / ".btrfs.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _make_image(image: Path, size_gb: int) -> None:
    tmp = image.with_name(image.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        # Sparse: the image takes host space only as btrfs writes to it. 0600: it holds every sandbox.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.truncate(size_gb * (1 << 30))
        _run(["mkfs.btrfs", "-q", "-L", "space-node", str(tmp)], "mkfs.btrfs")
        os.rename(tmp, image)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RuntimeFailure(f"cannot create btrfs image {image}: {exc}") from exc
    except RuntimeFailure:
        tmp.unlink(missing_ok=True)
        raise


def ensure_layout(root: Path) -> None:
    for name in LAYOUT:
        (root / name).mkdir(mode=0o700, exist_ok=True)


def ensure_btrfs(
    data_dir: str | os.PathLike[str],
    image_size_gb: int = DEFAULT_IMAGE_SIZE_GB,
    *,
    quota: bool | None = None,
) -> BtrfsFs:
    """Make `<data_dir>/fs` a btrfs root with the standard layout and return where everything is.

    Quotas (simple quotas where the kernel has them) are enabled at once on the loop image SPACE owns, so
    every extent written later is accounted and per-sandbox limits work from the first sandbox on. On a
    host btrfs filesystem they are enabled only with `quota=True`: quotas are filesystem-wide, and simple
    quotas set an incompat flag that older kernels refuse to mount, so that is the operator's decision.
    `quota=False` never enables them.
    """
    if image_size_gb < 1:
        raise InvalidArgument("image_size_gb must be at least 1", image_size_gb=image_size_gb)
    data = Path(os.path.abspath(data_dir))
    try:
        data.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeFailure(f"cannot create data dir {data}: {exc}") from exc
    root = data / MOUNT_NAME
    image = data / IMAGE_NAME
    with _locked(data):
        mounted = mount_source(root)
        if mounted is not None:
            source, fstype = mounted
            if fstype != "btrfs":
                raise InvalidArgument(f"{root} is mounted but is {fstype}, not btrfs", path=str(root))
            loop = source if source.startswith("/dev/loop") else None
            if loop is not None:
                _harden_mount(root)
            fs = BtrfsFs(data, root, image if image.exists() else None, loop)
        elif image.exists() or not btrfs.is_btrfs(data):
            if not image.exists():
                _make_image(image, image_size_gb)
            root.mkdir(exist_ok=True)
            _run(["mount", "-t", "btrfs", "-o", MOUNT_OPTIONS, str(image), str(root)], "mount btrfs image")
            # Shared propagation: a process that enters a new mount namespace as a slave (runsc's wrapper,
            # `ip netns exec`) gets a copy that our unmount removes too. On a host whose root mount is
            # private, a private copy would keep the filesystem, hence the loop device, busy after teardown.
            _run(["mount", "--make-shared", str(root)], "share the btrfs mount")
            mounted = mount_source(root)
            loop = mounted[0] if mounted else None
            fs = BtrfsFs(data, root, image, loop)
        else:
            # data_dir is on btrfs already: use a subvolume of it, so the whole node state is one subvolume.
            if not btrfs.is_subvolume(root):
                if root.exists():
                    raise InvalidArgument(f"{root} exists but is not a btrfs subvolume", path=str(root))
                btrfs.create_subvolume(root)
            fs = BtrfsFs(data, root, None, None)
        try:
            ensure_layout(fs.root)
            if fs.image is not None:
                os.chmod(fs.image, 0o600)  # an older run made it with the default umask
            restrict_images(fs.root)
        except OSError as exc:
            raise RuntimeFailure(f"cannot create the layout under {fs.root}: {exc}") from exc
        want_quota = quota if quota is not None else fs.image is not None
        mode = btrfs_quota.enable_quota(fs.root) if want_quota else btrfs_quota.quota_mode(fs.root)
        return dataclasses.replace(fs, quota=mode)


def unmount_btrfs(data_dir: str | os.PathLike[str], *, timeout: float = 60.0) -> None:
    """Unmount `<data_dir>/fs` (if mounted from the image) and detach every loop device of the image.

    The wait is long because the kernel releases a loop device only when the filesystem's last reference
    goes: a mount copy in a namespace of a process still exiting (runsc's gofer, a QEMU jail) keeps it, and
    on a loaded machine (load 10 on 2 cores) that took more than the 10 s this once waited.

    Raises RuntimeFailure if the filesystem is busy: a lazy unmount would hide a leak, so it is not done.
    A data dir on native btrfs is left alone (nothing is mounted by SPACE there).
    """
    data = Path(os.path.abspath(data_dir))
    if not data.exists():
        raise NotFound(f"data dir {data} does not exist", path=str(data))
    root = data / MOUNT_NAME
    image = data / IMAGE_NAME
    with _locked(data):
        # Several stacked mounts are possible if something mounted twice; take them all off.
        while mount_source(root) is not None:
            _run(["umount", str(root)], "umount")
        deadline = time.monotonic() + timeout
        while True:
            loops = loop_devices_for(image)
            if not loops:
                return
            for dev in loops:
                # Autoclear normally detached it at umount; a leftover (e.g. from `losetup` by hand) goes now.
                with contextlib.suppress(RuntimeFailure):
                    _run(["losetup", "-d", dev], "losetup -d")
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"loop devices still attached to {image}: {loops}", image=str(image))
            time.sleep(0.05)
