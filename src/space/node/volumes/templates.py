"""Templates: the read-only root filesystems sandboxes are snapshotted from.

Layers (all under `<btrfs root>/templates/`):
- `.base-bookworm-python`: read-only subvolume = `debootstrap --variant=minbase --include=python3,procps,
  ca-certificates bookworm` + user `user` (uid 1000), /work, neutral /etc/hostname, /etc/hosts, empty
  /etc/resolv.conf. Expensive (~1 min, network), so it is built once per machine and cached as a full
  `btrfs send` stream in the rootfs cache (default /var/cache/space/rootfs, outside every data dir); a new
  data dir gets it with one `btrfs receive` (seconds). Every node that receives the same stream gets a base
  with the same received UUID, so deltas sent with `-p <base>` apply on any of them.
- `python`: read-only snapshot of the base + SPACE's guest code in /opt/space/lib/space (protocol, guest),
  byte-compiled by the template's own python3 (chroot), so the .pyc match the guest interpreter. A change
  of the guest code (its hash) rebuilds only this layer: a snapshot, a copy and a compileall (~0.3 s).

Invariants:
- A layer is complete iff its metadata file (`<layer>.json`, next to the subvolume, written atomically and
  last) exists and names the same content hash; anything else found (a subvolume without metadata, a
  `.new` leftover, a half-received base) is from a killed run and is deleted and rebuilt.
- The metadata of `python` is removed *before* the subvolume is replaced, so no reader can pair new
  metadata with an old tree or the reverse.
- Host-specific files that debootstrap copies from the host (hostname, hosts, resolv.conf) are replaced:
  no host detail leaks into a sandbox.
- Network traffic happens only in debootstrap, only to the mirror of the machine's apt sources.
- Concurrent builders are serialized by flocks (one on the cache dir, one on the templates dir).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from space.core.errors import InvalidArgument, NotFound, RuntimeFailure, SpaceError
from space.node.volumes import btrfs, btrfs_receive, filesystem, sendstream
from space.node.volumes.mirror import find_mirror

Progress = Callable[[str], None]

SUITE = "bookworm"
VARIANT = "minbase"
PACKAGES = ("python3", "procps", "ca-certificates")
BASE_VERSION = "v1"  # bump when the base recipe (packages, customization) changes: new cache file name
BASE_NAME = f".base-{SUITE}-python"
CACHE_NAME = f"{SUITE}-{VARIANT}-python-{BASE_VERSION}.btrfs-stream"
DEFAULT_CACHE_DIR = Path("/var/cache/space/rootfs")
TEMPLATE_NAMES = ("python",)
METADATA_FORMAT = 1
#: A root filesystem's files are the guest's and get a Debian system's modes, not the owner-only umask that
#: the helper itself runs with (ADR 0022): what this module writes into one is given its mode explicitly,
#: and what it runs on one (debootstrap, chroot) runs with this umask.
ROOTFS_UMASK = 0o022

GUEST_LIB = "/opt/space/lib"  # inside the template
GUEST_PYTHON = "/usr/bin/python3"
USER_NAME = "user"
USER_UID = 1000
HOSTNAME = "sandbox"
# The in-sandbox daemon's entry point. Flags chosen by measurement (docs/adr/0004-btrfs-volumes.md):
#   -I  isolated: ignore PYTHON* env vars and the user site dir, so nothing the workload sets changes the
#       daemon (it also ignores PYTHONPATH, hence the explicit sys.path entry below);
#   -S  no `site`: the daemon is stdlib-only, and skipping site is the largest startup saving;
#   -B  never write .pyc: the daemon must not write into the sandbox's root filesystem (snapshot deltas).
GUEST_BOOTSTRAP = (
    f"import sys; sys.path.insert(0, {GUEST_LIB!r}); import runpy; "
    "runpy.run_module('space.guest', run_name='__main__', alter_sys=True)"
)
GUEST_ARGV = (GUEST_PYTHON, "-I", "-S", "-B", "-c", GUEST_BOOTSTRAP)
GUEST_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
}
# Bumped when the guest layer recipe changes; part of the guest code hash, so it forces a cheap rebuild.
GUEST_LAYER_VERSION = "guest-layer-1"


def guest_command() -> list[str]:
    """argv of the sandbox's init (the daemon `spaced`), to run with GUEST_ENV as its environment."""
    return list(GUEST_ARGV)


@dataclass(frozen=True)
class Template:
    name: str
    path: Path  # read-only subvolume
    metadata: dict[str, Any]


def default_progress(line: str) -> None:
    # debootstrap's stage lines ("I: Retrieving ...", "I: Extracting ...") and our own "space: ..." lines.
    if line.startswith(("I: ", "W: ", "E: ", "space: ")):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def default_cache_dir() -> Path:
    env = os.environ.get("SPACE_ROOTFS_CACHE")
    return Path(env) if env else DEFAULT_CACHE_DIR


# --- small helpers --------------------------------------------------------------------------------------
@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _run(argv: list[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)
    except FileNotFoundError as exc:
        raise RuntimeFailure(f"{what}: {argv[0]} is not installed") from exc
    except subprocess.CalledProcessError as exc:
        detail = ((exc.stderr or "") + (exc.stdout or "")).strip()[-2000:]
        raise RuntimeFailure(f"{what} failed: {detail}", argv=argv) from exc


def _tree_size(root: Path) -> int:
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


def _unmount_under(path: Path) -> None:
    """Unmount whatever a killed debootstrap/chroot left mounted inside `path` (deepest first)."""
    prefix = os.path.realpath(path) + "/"
    with open("/proc/self/mounts") as f:
        targets = [line.split()[1].replace("\\040", " ") for line in f]
    for target in sorted((t for t in targets if t.startswith(prefix)), key=len, reverse=True):
        _run(["umount", "-l", target], "umount leftover mount")


def _discard_subvolume(path: Path) -> None:
    if not os.path.lexists(path):
        return
    _unmount_under(path)
    if btrfs.is_subvolume(path):
        btrfs.delete_subvolume(path)
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


# --- guest code -----------------------------------------------------------------------------------------
def default_guest_src() -> Path:
    """The directory holding the `space` package sources (`.../src/space`)."""
    spec = importlib.util.find_spec("space.protocol")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("cannot locate the space.protocol sources")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _guest_files(space_src: Path) -> list[tuple[str, bytes]]:
    """(path relative to the `space` package, content) of every guest-side source file, sorted.

    The guest gets an empty `space/__init__.py` (the host package's own, if any, may import host-only code).
    """
    files: list[tuple[str, bytes]] = [("__init__.py", b"")]
    for sub in ("protocol", "guest"):
        top = space_src / sub
        if not top.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith((".pyc", ".pyo")) or name.startswith("."):
                    continue
                full = Path(dirpath) / name
                files.append((str(full.relative_to(space_src)), full.read_bytes()))
    files.sort()
    return files


def guest_code_hash(space_src: Path | None = None) -> str:
    files = _guest_files(space_src or default_guest_src())
    h = hashlib.sha256(GUEST_LAYER_VERSION.encode() + b"\0" + GUEST_BOOTSTRAP.encode() + b"\0")
    for rel, data in files:
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


# --- base layer -----------------------------------------------------------------------------------------
def _debootstrap(target: Path, mirror: str, progress: Progress) -> None:
    argv = [
        "debootstrap",
        f"--variant={VARIANT}",
        f"--include={','.join(PACKAGES)}",
        SUITE,
        str(target),
        mirror,
    ]
    # The node's filesystem is mounted nodev; debootstrap's chroot scripts need /dev/null & co.
    argv = filesystem.with_device_nodes(target, argv)
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LC_ALL": "C",
        "DEBIAN_FRONTEND": "noninteractive",
    }
    progress(f"space: debootstrap {SUITE} ({VARIANT} + {', '.join(PACKAGES)}) from {mirror}")
    tail: deque[str] = deque(maxlen=40)
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1,
            umask=ROOTFS_UMASK,
        )  # fmt: skip
    except FileNotFoundError as exc:
        raise RuntimeFailure("debootstrap is not installed") from exc
    assert proc.stdout is not None
    with proc:
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            progress(line)
    if proc.returncode != 0:
        raise RuntimeFailure(f"debootstrap failed (exit {proc.returncode}): " + "\n".join(tail), argv=argv)


def _customize_base(root: Path) -> None:
    """Make the debootstrapped tree a neutral sandbox root: user, /work, no host-derived files."""
    (root / "etc/hostname").write_text(HOSTNAME + "\n")
    (root / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    # Empty: the sandbox's DNS is decided at run time (egress gateway), never inherited from the host.
    (root / "etc/resolv.conf").write_text("")
    for name in ("etc/hostname", "etc/hosts", "etc/resolv.conf"):
        os.chmod(root / name, 0o644)
    _run(
        [
            "chroot",
            str(root),
            "useradd",
            "--uid",
            str(USER_UID),
            "--user-group",
            "--create-home",
            "--shell",
            "/bin/bash",
            USER_NAME,
        ],
        "useradd in template",
        umask=ROOTFS_UMASK,
    )
    work = root / "work"
    work.mkdir(exist_ok=True)
    os.chown(work, USER_UID, USER_UID)
    # 0777 (owned by `user`): both root and `user` write there even when the runtime drops root's
    # CAP_DAC_OVERRIDE; no sticky bit, so either can also clean up the other's files.
    os.chmod(work, 0o777)  # noqa: S103 - deliberate, see above
    # Package caches: not needed at run time and they would inflate every template copy.
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = root / sub
        if d.is_dir():
            for entry in d.iterdir():
                if entry.is_file() and entry.name != "lock":
                    entry.unlink()
    with contextlib.suppress(FileNotFoundError):
        (root / "var/log/bootstrap.log").unlink()


def _base_metadata(base: Path, created: str, built_here: bool) -> dict[str, Any]:
    return {
        "format": METADATA_FORMAT,
        "layer": BASE_NAME,
        "suite": SUITE,
        "variant": VARIANT,
        "packages": list(PACKAGES),
        "version": BASE_VERSION,
        "created": created,
        "built_here": built_here,
        "size_bytes": _tree_size(base),
    }


def _build_base_into_cache(templates: Path, cache: Path, mirror: str | None, progress: Progress) -> None:
    """debootstrap a base in `templates/BASE_NAME`, make it read-only, write it to the cache as a stream."""
    base = templates / BASE_NAME
    _discard_subvolume(base)
    btrfs.create_subvolume(base)
    os.chmod(base, 0o755)  # noqa: S103 - the guest's "/" (a new subvolume's root takes the helper's umask)
    t0 = time.monotonic()
    _debootstrap(base, mirror or find_mirror(), progress)
    _customize_base(base)
    btrfs.set_readonly(base, True)
    progress(f"space: base built in {time.monotonic() - t0:.1f} s; writing cache {cache}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            btrfs_receive.send(base, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, cache)  # a present cache file is always a complete stream
    finally:
        tmp.unlink(missing_ok=True)


def ensure_base(
    templates: Path,
    *,
    cache_dir: Path | None = None,
    mirror: str | None = None,
    progress: Progress = default_progress,
) -> Path:
    """The read-only base subvolume `templates/.base-bookworm-python`, from the cache or built."""
    base = templates / BASE_NAME
    marker = templates / f"{BASE_NAME}.json"
    meta = _read_json(marker)
    if meta and meta.get("version") == BASE_VERSION and btrfs.is_subvolume(base) and btrfs.get_readonly(base):
        return base
    marker.unlink(missing_ok=True)
    _discard_subvolume(base)  # half-built or half-received by a killed run
    cache = (cache_dir or default_cache_dir()) / CACHE_NAME
    with _flock(cache.parent / ".lock"):
        built_here = False
        if cache.exists():
            t0 = time.monotonic()
            progress(f"space: receiving cached base {cache}")
            try:
                with btrfs_receive.open_stream(cache) as stream:
                    btrfs_receive.receive(stream, templates, expected=sendstream.Expected.full(BASE_NAME))
            except SpaceError as exc:
                # A corrupt or foreign cache file: drop it and rebuild from the mirror.
                progress(f"space: cached base unusable ({exc.message}); rebuilding")
                _discard_subvolume(base)
                cache.unlink(missing_ok=True)
            else:
                progress(f"space: base received in {time.monotonic() - t0:.1f} s")
        if not cache.exists():
            _build_base_into_cache(templates, cache, mirror, progress)
            built_here = True
    _write_json_atomic(marker, _base_metadata(base, _now(), built_here))
    return base


# --- guest layer ----------------------------------------------------------------------------------------
def _install_guest_code(root: Path, space_src: Path) -> int:
    lib = root / GUEST_LIB.lstrip("/")
    pkg = lib / "space"
    if pkg.exists():
        shutil.rmtree(pkg)
    size = 0
    for rel, data in _guest_files(space_src):
        dst = pkg / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        os.chmod(dst, 0o644)
        size += len(data)
    for d in [lib, *(p for p in lib.rglob("*") if p.is_dir())]:
        os.chmod(d, 0o755)  # noqa: S103 - world-readable code, writable by root only
    # Compile with the template's own interpreter (its magic number and paths); the template is read-only
    # afterwards, so without this every daemon start would compile from source.
    _run(
        ["chroot", str(root), GUEST_PYTHON, "-I", "-m", "compileall", "-q", "-j", "0", GUEST_LIB],
        "compileall in template",
        umask=ROOTFS_UMASK,  # __pycache__ directories readable by the guest's users
    )
    return size


def ensure_template(
    fs_root: str | os.PathLike[str],
    name: str = "python",
    *,
    progress: Progress = default_progress,
    cache_dir: Path | None = None,
    mirror: str | None = None,
    guest_src: Path | None = None,
) -> Template:
    """Return the read-only template `<fs_root>/templates/<name>`, building only what is missing or stale.

    Idempotent and safe after a killed run (see the module invariants). `guest_src` is the directory of the
    `space` package sources (default: where `space.protocol` is imported from).
    """
    if name not in TEMPLATE_NAMES:
        raise InvalidArgument(f"unknown template {name!r}", known=list(TEMPLATE_NAMES))
    templates = Path(fs_root) / "templates"
    if not btrfs.is_btrfs(templates):
        raise InvalidArgument(f"{templates} is not on btrfs (call ensure_btrfs first)", path=str(templates))
    space_src = guest_src or default_guest_src()
    target = templates / name
    meta_path = templates / f"{name}.json"
    staging = templates / f".{name}.new"
    with _flock(templates / ".lock"):
        code_hash = guest_code_hash(space_src)
        meta = _read_json(meta_path)
        if (
            meta is not None
            and meta.get("guest_code_hash") == code_hash
            and meta.get("format") == METADATA_FORMAT
            and btrfs.is_subvolume(target)
            and btrfs.get_readonly(target)
        ):
            return Template(name, target, meta)
        base = ensure_base(templates, cache_dir=cache_dir, mirror=mirror, progress=progress)
        base_meta = _read_json(templates / f"{BASE_NAME}.json") or {}
        t0 = time.monotonic()
        _discard_subvolume(staging)
        btrfs.snapshot(base, staging, readonly=False)
        guest_size = _install_guest_code(staging, space_src)
        btrfs.set_readonly(staging, True)
        # Metadata goes first, then the old tree, then the new tree moves in; metadata is written last.
        meta_path.unlink(missing_ok=True)
        _discard_subvolume(target)
        try:
            os.rename(staging, target)
        except OSError as exc:
            raise RuntimeFailure(f"cannot move {staging} to {target}: {exc}") from exc
        meta = {
            "format": METADATA_FORMAT,
            "name": name,
            "created": _now(),
            "suite": SUITE,
            "variant": VARIANT,
            "packages": list(PACKAGES),
            "base": BASE_NAME,
            "base_version": BASE_VERSION,
            "base_created": base_meta.get("created"),
            "guest_code_hash": code_hash,
            "guest_lib": GUEST_LIB,
            "guest_command": guest_command(),
            "size_bytes": int(base_meta.get("size_bytes", 0)) + guest_size,
            "subvolume_id": btrfs.subvolume_id(target),
        }
        _write_json_atomic(meta_path, meta)
        progress(f"space: template {name} ready ({time.monotonic() - t0:.2f} s for the guest layer)")
        return Template(name, target, meta)


# --- the base through object storage ---------------------------------------------------------------------
# Deltas of sandboxes are sent with `-p <base>`, so every node must hold a base that the receiver recognises
# as that parent: the same received UUID. Only the *original* full stream gives that (a full send of a
# received base would carry a new UUID), so a node publishes either the base it built itself or the cache
# stream it received its base from, never a re-send of a received base.
def base_status(templates: Path, *, cache_dir: Path | None = None) -> dict[str, Any]:
    """Whether the base is here (complete), its identity (the UUID deltas name), and whether this node
    holds an original full stream of it that it could publish."""
    base = templates / BASE_NAME
    meta = _read_json(templates / f"{BASE_NAME}.json")
    present = bool(
        meta and meta.get("version") == BASE_VERSION and btrfs.is_subvolume(base) and btrfs.get_readonly(base)
    )
    status: dict[str, Any] = {
        "name": BASE_NAME,
        "version": BASE_VERSION,
        "present": present,
        "identity": None,
        "publishable": False,
        "source": (meta or {}).get("source"),
    }
    if not present:
        return status
    ident = btrfs.subvolume_identity(base)
    status["identity"] = ident.received_uuid or ident.uuid
    original = ident.received_uuid is None or _cache_stream_uuid(cache_dir) == ident.received_uuid
    status["publishable"] = original
    return status


def _cache_stream_uuid(cache_dir: Path | None) -> str | None:
    cache = (cache_dir or default_cache_dir()) / CACHE_NAME
    try:
        with btrfs_receive.open_stream(cache) as f:
            return sendstream.read_header(f).uuid
    except (OSError, SpaceError):
        return None


def export_base(templates: Path, out: Path, *, cache_dir: Path | None = None) -> dict[str, Any]:
    """Write the base's original full send stream to `out`; returns {"identity", "bytes"}."""
    status = base_status(templates, cache_dir=cache_dir)
    if not status["present"]:
        raise NotFound(f"the template base {BASE_NAME} is not on this node")
    if not status["publishable"]:
        raise NotFound(f"this node received {BASE_NAME} and no longer holds the original stream of it")
    base = templates / BASE_NAME
    ident = btrfs.subvolume_identity(base)
    if ident.received_uuid is None:
        with open(out, "wb") as f:
            btrfs_receive.send(base, f)
    else:
        shutil.copyfile((cache_dir or default_cache_dir()) / CACHE_NAME, out)
    with open(out, "rb") as f:
        header = sendstream.read_header(f)
    if header.kind != "full" or header.name != BASE_NAME or header.uuid != status["identity"]:
        out.unlink(missing_ok=True)
        raise RuntimeFailure(f"the stream of {BASE_NAME} does not carry the base's identity")
    return {"identity": header.uuid, "bytes": out.stat().st_size, "version": BASE_VERSION}


def import_base(
    templates: Path, stream: BinaryIO, *, progress: Progress = default_progress
) -> dict[str, Any]:
    """Install the base from an original full stream (downloaded and verified by the caller); idempotent:
    a complete base already here is kept. Serialised with template builds by the templates lock.

    `stream` is read once, by `btrfs_receive.receive`, which refuses anything but a full stream of
    BASE_NAME."""
    with _flock(templates / ".lock"):
        status = base_status(templates)
        if status["present"]:
            return {"identity": status["identity"], "received": False}
        (templates / f"{BASE_NAME}.json").unlink(missing_ok=True)
        _discard_subvolume(templates / BASE_NAME)  # half-received by a killed run
        t0 = time.monotonic()
        got = btrfs_receive.receive(stream, templates, expected=sendstream.Expected.full(BASE_NAME))
        progress(f"space: base received from object storage in {time.monotonic() - t0:.1f} s")
        identity = btrfs.subvolume_identity(got).received_uuid
        meta = _base_metadata(got, _now(), built_here=False)
        meta["source"] = "objectstore"
        _write_json_atomic(templates / f"{BASE_NAME}.json", meta)
    return {"identity": identity, "received": True}
