"""Package layers: the base plus a few more Debian packages, for built-in templates that need them (ADR 0064).

`.pkgs-<name>-<version>` (under `<btrfs root>/templates/`) is a read-only snapshot of the base
(space.node.volumes.template_base) into which `apt-get install --no-install-recommends <packages>` ran in a
chroot, from the same Debian mirror the base was debootstrapped from (the machine's apt sources), with the
apt caches emptied afterwards. The `browser` template's layer (Chromium and fonts) takes ~1 min and ~200 MB
of downloads, so it is built once per machine and cached next to the base's stream as a *delta* against the
base (`btrfs send -p`): every node that received the same base stream receives it in seconds.

Invariants:
- A layer is complete iff its metadata file (`<layer>.json`, written last) names the layer's version and
  the base version, and the subvolume is read-only; anything else is from a killed run and is rebuilt.
- A present cache file is always a complete stream (written to a temporary name, fsynced, renamed); one
  that does not apply (a base rebuilt since, a corrupt file) is deleted and the layer rebuilt.
- Network traffic happens only in `apt-get`, only to the mirror the base's apt sources name. The host's
  resolv.conf is in the tree only while apt runs; the layer ends with the base's empty one, so no host
  detail leaks into a sandbox.
- Builders of one layer are serialized by a flock of their own in the cache dir, layer changes by the
  caller's templates lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any

from space.core.errors import RuntimeFailure, SpaceError
from space.node.volumes import btrfs, btrfs_receive, filesystem, sendstream
from space.node.volumes.template_base import BASE_VERSION, CACHE_NAME, default_cache_dir
from space.node.volumes.template_files import (
    METADATA_FORMAT,
    ROOTFS_UMASK,
    Progress,
    default_progress,
    discard_subvolume,
    flock,
    now,
    read_json,
    tree_size,
    write_json_atomic,
)

_APT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LC_ALL": "C",
    "DEBIAN_FRONTEND": "noninteractive",
}


def layer_name(name: str, version: str) -> str:
    return f".pkgs-{name}-{version}"


def _cache_name(name: str, version: str) -> str:
    # Named after the base stream it is a delta of: a new base recipe gives a new name, never a stale file.
    return f"{CACHE_NAME.removesuffix('.btrfs-stream')}+{name}-{version}.btrfs-stream"


def _apt_install(root: Path, packages: tuple[str, ...], progress: Progress) -> None:
    script = (
        'mount -t proc proc "$1/proc" && shift && '
        'chroot "$0" apt-get update -q && '
        'chroot "$0" apt-get install -y -q --no-install-recommends "$@"'
    )
    # Device nodes (and /proc) for dpkg's scripts: in a private mount namespace that goes with the process.
    argv = filesystem.with_device_nodes(root, ["sh", "-c", script, str(root), str(root), *packages])
    resolv = root / "etc/resolv.conf"
    shutil.copyfile("/etc/resolv.conf", resolv)  # apt resolves the mirror's name as the host does
    tail: deque[str] = deque(maxlen=40)
    try:
        progress(f"space: apt-get install {' '.join(packages)}")
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_APT_ENV, bufsize=1,
            umask=ROOTFS_UMASK,
        )  # fmt: skip
        assert proc.stdout is not None
        with proc:
            for raw in proc.stdout:
                tail.append(raw.rstrip("\n"))
                progress(tail[-1])
        if proc.returncode != 0:
            raise RuntimeFailure(f"apt-get failed (exit {proc.returncode}): " + "\n".join(tail), argv=argv)
    finally:
        resolv.write_text("")  # the sandbox's DNS is decided at run time, never the host's
        os.chmod(resolv, 0o644)
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "var/cache/apt"):
        d = root / sub
        if d.is_dir():
            for entry in d.iterdir():
                if entry.is_file() and entry.name != "lock":
                    entry.unlink()
    for log in ("var/log/apt/term.log", "var/log/apt/history.log", "var/log/dpkg.log"):
        with contextlib.suppress(FileNotFoundError):
            (root / log).unlink()


def _build_into_cache(
    base: Path, layer: Path, packages: tuple[str, ...], cache: Path, *, progress: Progress
) -> None:
    discard_subvolume(layer)
    btrfs.snapshot(base, layer, readonly=False)
    t0 = time.monotonic()
    _apt_install(layer, packages, progress)
    btrfs.set_readonly(layer, True)
    progress(f"space: {layer.name} built in {time.monotonic() - t0:.1f} s; writing cache {cache}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            btrfs_receive.send(layer, f, parent=base)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, cache)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_packages(
    templates: Path,
    base: Path,
    name: str,
    version: str,
    packages: tuple[str, ...],
    *,
    cache_dir: Path | None = None,
    progress: Progress = default_progress,
) -> Path:
    """The read-only layer `templates/.pkgs-<name>-<version>`: the base + `packages`, from the cache or
    built. The caller holds the templates lock; `base` is the complete base (ensure_base)."""
    layer = templates / layer_name(name, version)
    marker = templates / f"{layer.name}.json"
    meta = read_json(marker)
    if (
        meta
        and meta.get("version") == version
        and meta.get("base_version") == BASE_VERSION
        and btrfs.is_subvolume(layer)
        and btrfs.get_readonly(layer)
    ):
        return layer
    marker.unlink(missing_ok=True)
    discard_subvolume(layer)
    cache = (cache_dir or default_cache_dir()) / _cache_name(name, version)
    ident = btrfs.subvolume_identity(base)
    base_uuid = ident.received_uuid or ident.uuid
    built_here = False
    # A lock of its own: a minute of apt here must not hold up a base receive in another data dir.
    with flock(cache.parent / f".lock{layer.name}"):
        if cache.exists():
            t0 = time.monotonic()
            try:
                with btrfs_receive.open_stream(cache) as stream:
                    btrfs_receive.receive(
                        stream, templates, expected=sendstream.Expected.delta(layer.name, {base_uuid})
                    )
            except SpaceError as exc:
                progress(f"space: cached {layer.name} unusable ({exc.message}); rebuilding")
                discard_subvolume(layer)
                cache.unlink(missing_ok=True)
            else:
                progress(f"space: {layer.name} received in {time.monotonic() - t0:.1f} s")
        if not cache.exists():
            _build_into_cache(base, layer, packages, cache, progress=progress)
            built_here = True
    meta_out: dict[str, Any] = {
        "format": METADATA_FORMAT,
        "layer": layer.name,
        "packages": list(packages),
        "version": version,
        "base_version": BASE_VERSION,
        "created": now(),
        "built_here": built_here,
        "size_bytes": tree_size(layer),
    }
    write_json_atomic(marker, meta_out)
    return layer
