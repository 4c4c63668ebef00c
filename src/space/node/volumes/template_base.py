"""The template base: the Debian root filesystem every template is a snapshot of, built once per machine,
cached as a full send stream, and passed between nodes through object storage.

`.base-bookworm-python` (under `<btrfs root>/templates/`) is a read-only subvolume = `debootstrap
--variant=minbase --include=python3,procps,ca-certificates,git,curl,sudo bookworm` + user `user` (uid 1000,
home /home/user), /work, neutral /etc/hostname, /etc/hosts, empty /etc/resolv.conf. Every built-in template
(`python`, `base`) is a snapshot of this one base and differs from the others only in its small own layer
and metadata (ADR 0057: one base keeps every sandbox's snapshot delta against it small). Expensive (~1-4
min, network), so it is built once
per machine and cached as a full `btrfs send` stream in the rootfs cache (default /var/cache/space/rootfs,
outside every data dir); a new data dir gets it with one `btrfs receive` (seconds). Every node that
receives the same stream gets a base with the same received UUID, so deltas sent with `-p <base>` apply on
any of them.

Invariants:
- The base is complete iff its metadata file (`.base-bookworm-python.json`, written atomically and last)
  exists and names BASE_VERSION, and the subvolume is read-only; anything else found is from a killed run
  and is deleted and rebuilt. A present cache file is always a complete stream.
- Host-specific files that debootstrap copies from the host (hostname, hosts, resolv.conf) are replaced:
  no host detail leaks into a sandbox.
- Network traffic happens only in debootstrap, only to the mirror of the machine's apt sources.
- Builders are serialized by a flock on the cache dir; imports by the templates lock.
- A node publishes only an *original* full stream of its base (the one it built, or the cache stream it
  received from), never a re-send of a received base (that would carry a new UUID).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from space.core.errors import NotFound, RuntimeFailure, SpaceError
from space.node.volumes import btrfs, btrfs_receive, filesystem, sendstream
from space.node.volumes.mirror import find_mirror
from space.node.volumes.template_files import (
    METADATA_FORMAT,
    ROOTFS_UMASK,
    Progress,
    default_progress,
    discard_subvolume,
    flock,
    now,
    read_json,
    run,
    tree_size,
    write_json_atomic,
)

SUITE = "bookworm"
VARIANT = "minbase"
PACKAGES = ("python3", "procps", "ca-certificates", "git", "curl", "sudo")
BASE_VERSION = "v2"  # bump when the base recipe (packages, customization) changes: new cache file name
BASE_NAME = f".base-{SUITE}-python"
CACHE_NAME = f"{SUITE}-{VARIANT}-python-{BASE_VERSION}.btrfs-stream"
DEFAULT_CACHE_DIR = Path("/var/cache/space/rootfs")
USER_NAME = "user"
USER_UID = 1000
HOSTNAME = "sandbox"


def default_cache_dir() -> Path:
    env = os.environ.get("SPACE_ROOTFS_CACHE")
    return Path(env) if env else DEFAULT_CACHE_DIR


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
    run(
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
        "size_bytes": tree_size(base),
    }


def _build_base_into_cache(templates: Path, cache: Path, mirror: str | None, progress: Progress) -> None:
    """debootstrap a base in `templates/BASE_NAME`, make it read-only, write it to the cache as a stream."""
    base = templates / BASE_NAME
    discard_subvolume(base)
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
    meta = read_json(marker)
    if meta and meta.get("version") == BASE_VERSION and btrfs.is_subvolume(base) and btrfs.get_readonly(base):
        return base
    marker.unlink(missing_ok=True)
    discard_subvolume(base)  # half-built or half-received by a killed run
    cache = (cache_dir or default_cache_dir()) / CACHE_NAME
    with flock(cache.parent / ".lock"):
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
                discard_subvolume(base)
                cache.unlink(missing_ok=True)
            else:
                progress(f"space: base received in {time.monotonic() - t0:.1f} s")
        if not cache.exists():
            _build_base_into_cache(templates, cache, mirror, progress)
            built_here = True
    write_json_atomic(marker, _base_metadata(base, now(), built_here))
    return base


# --- the base through object storage ---------------------------------------------------------------------
# Deltas of sandboxes are sent with `-p <base>`, so every node must hold a base that the receiver recognises
# as that parent: the same received UUID. Only the *original* full stream gives that (a full send of a
# received base would carry a new UUID), so a node publishes either the base it built itself or the cache
# stream it received its base from, never a re-send of a received base.
def base_status(templates: Path, *, cache_dir: Path | None = None) -> dict[str, Any]:
    """Whether the base is here (complete), its identity (the UUID deltas name), and whether this node
    holds an original full stream of it that it could publish."""
    base = templates / BASE_NAME
    meta = read_json(templates / f"{BASE_NAME}.json")
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
    with flock(templates / ".lock"):
        status = base_status(templates)
        if status["present"]:
            return {"identity": status["identity"], "received": False}
        (templates / f"{BASE_NAME}.json").unlink(missing_ok=True)
        discard_subvolume(templates / BASE_NAME)  # half-received by a killed run
        t0 = time.monotonic()
        got = btrfs_receive.receive(stream, templates, expected=sendstream.Expected.full(BASE_NAME))
        progress(f"space: base received from object storage in {time.monotonic() - t0:.1f} s")
        identity = btrfs.subvolume_identity(got).received_uuid
        meta = _base_metadata(got, now(), built_here=False)
        meta["source"] = "objectstore"
        write_json_atomic(templates / f"{BASE_NAME}.json", meta)
    return {"identity": identity, "received": True}
