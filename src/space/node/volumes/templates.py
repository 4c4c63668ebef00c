"""Templates: the read-only root filesystems sandboxes are snapshotted from. This module builds the guest
layer on top of the base layer (space.node.volumes.template_base); the build tools both use are in
space.node.volumes.template_files.

Layers (all under `<btrfs root>/templates/`):
- `.base-bookworm-python`: the Debian base, built once per machine and cached (see template_base).
- each built-in template (BUILTIN_TEMPLATES: `python`, `base`): read-only snapshot of the base + SPACE's
  guest code in /opt/space/lib/space (protocol, guest), byte-compiled by the template's own python3
  (chroot), so the .pyc match the guest interpreter, + the template's own few files (`base`: its sudoers
  entry). A change of the guest code or of the recipe (its hash) rebuilds only this layer: a snapshot, a
  copy and a compileall (~0.3 s). The metadata carries the defaults `default_user`, `workdir`, `env` that
  `guest_environment` turns into the daemon's boot environment (ADR 0057).

Invariants:
- A layer is complete iff its metadata file (`<layer>.json`, next to the subvolume, written atomically and
  last) exists and names the same content hash and base version; anything else found (a subvolume without
  metadata, a `.new` leftover, a half-received base) is from a killed run and is deleted and rebuilt.
- The metadata of `python` is removed *before* the subvolume is replaced, so no reader can pair new
  metadata with an old tree or the reverse.
- Concurrent builders are serialized by flocks (one on the cache dir, one on the templates dir).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from space.core.errors import InvalidArgument, NotFound, RuntimeFailure
from space.node.volumes import btrfs
from space.node.volumes.template_base import (
    BASE_NAME,
    BASE_VERSION,
    PACKAGES,
    SUITE,
    USER_NAME,
    VARIANT,
    ensure_base,
)
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
    write_json_atomic,
)
from space.node.volumes.template_packages import ensure_packages

GUEST_LIB = "/opt/space/lib"  # inside the template
GUEST_PYTHON = "/usr/bin/python3"
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
GUEST_LAYER_VERSION = "guest-layer-2"


def guest_command() -> list[str]:
    """argv of the sandbox's init (the daemon `spaced`), to run with GUEST_ENV as its environment."""
    return list(GUEST_ARGV)


@dataclass(frozen=True)
class BuiltinTemplate:
    """A template every node can build from its base: the guest layer plus these files and defaults.

    `default_user`, `workdir` and `env` become the template metadata keys of the same names, which the node
    applies to every exec, PTY and file write that does not name its own user/cwd (ADR 0057); None/empty
    means "the guest's defaults" (root, /, GUEST_ENV), which is what `python` has always had."""

    name: str
    description: str
    default_user: str | None = None
    workdir: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    # (absolute path in the template, content, mode): written into the template's own layer.
    files: tuple[tuple[str, str, int], ...] = ()
    # Debian packages installed on the base in a cached layer of their own (template_packages, ADR 0064);
    # `packages_version` names that layer and its cache file: bump it when `packages` change.
    packages: tuple[str, ...] = ()
    packages_version: str = ""


_USER_HOME = f"/home/{USER_NAME}"
SUDO_WRAPPER = (
    "#!/bin/sh\n"
    "# SPACE (ADR 0057): setuid binaries do not gain privileges under gVisor; the sandbox's daemon runs it.\n"
    f'exec {GUEST_PYTHON} -I -S -B {GUEST_LIB}/space/guest/sudo_client.py "$@"\n'
)
# The browser template (ADR 0064): Chromium headless with its DevTools port on the sandbox's loopback only.
# --no-sandbox: Chromium's own sandbox needs user namespaces or a setuid helper, neither of which gVisor
# gives an unprivileged user; the gVisor sandbox around the whole sandbox is the isolation boundary.
BROWSER_PACKAGES = ("chromium", "fonts-liberation", "fonts-dejavu-core")
BROWSER_CDP_PORT = 9222
BROWSER_START = "/opt/space/browser/start"
BROWSER_START_SCRIPT = (
    "#!/bin/sh\n"
    "# SPACE (ADR 0064): Chromium headless, DevTools on the sandbox's loopback; started by the CDP relay.\n"
    "mkdir -p /tmp/space-browser\n"
    "exec setsid /usr/bin/chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \\\n"
    f"  --remote-debugging-address=127.0.0.1 --remote-debugging-port={BROWSER_CDP_PORT} \\\n"
    "  --user-data-dir=/tmp/space-browser --no-first-run --no-default-browser-check \\\n"
    "  about:blank </dev/null >/tmp/space-browser/chromium.log 2>&1\n"
)
BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "python": BuiltinTemplate(
        name="python",
        description="Debian bookworm with python3; execs run as root in / unless they say otherwise",
    ),
    "base": BuiltinTemplate(
        name="base",
        description=(
            f"Debian bookworm with python3, git, curl and sudo; execs run as {USER_NAME!r} in {_USER_HOME}, "
            "who has passwordless sudo"
        ),
        default_user=USER_NAME,
        workdir=_USER_HOME,
        env=(("HOME", _USER_HOME), ("USER", USER_NAME), ("LOGNAME", USER_NAME)),
        files=(
            (f"/etc/sudoers.d/{USER_NAME}", f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL\n", 0o440),
            # gVisor ignores setuid bits, so Debian's sudo cannot work: this one (first on PATH) asks the
            # sandbox's daemon, which serves the default user only (space.guest.sudo).
            ("/usr/local/bin/sudo", SUDO_WRAPPER, 0o755),
        ),
    ),
}
BUILTIN_TEMPLATES["browser"] = BuiltinTemplate(
    name="browser",
    description=(
        "base + Debian's Chromium and fonts; its DevTools protocol through SPACE "
        "(GET /v1/sandboxes/{id}/cdp), Chromium started headless on first use"
    ),
    default_user=BUILTIN_TEMPLATES["base"].default_user,
    workdir=BUILTIN_TEMPLATES["base"].workdir,
    env=BUILTIN_TEMPLATES["base"].env,
    files=(*BUILTIN_TEMPLATES["base"].files, (BROWSER_START, BROWSER_START_SCRIPT, 0o755)),
    packages=BROWSER_PACKAGES,
    packages_version="p1",
)
TEMPLATE_NAMES = tuple(BUILTIN_TEMPLATES)  # the names ensure_template builds


def builtin_defaults(name: str) -> dict[str, Any]:
    """The metadata keys default_user/workdir/env of a built-in template (only those it sets)."""
    spec = BUILTIN_TEMPLATES[name]
    out: dict[str, Any] = {}
    if spec.default_user is not None:
        out["default_user"] = spec.default_user
    if spec.workdir is not None:
        out["workdir"] = spec.workdir
    if spec.env:
        out["env"] = dict(spec.env)
    return out


# What a template's metadata may say about its sandboxes' defaults (ADR 0057), checked before it reaches a
# daemon's environment: a user name or uid, an absolute path, and plain variables.
_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,63}|[0-9]{1,9}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
MAX_TEMPLATE_ENV = 256
MAX_TEMPLATE_VALUE = 32 << 10


def _checked_defaults(name: str, meta: dict[str, Any]) -> tuple[str | None, str | None, dict[str, str]]:
    user, workdir, env = meta.get("default_user"), meta.get("workdir"), meta.get("env") or {}
    if user is not None and not (isinstance(user, str) and _USER_RE.fullmatch(user)):
        raise RuntimeFailure(f"template {name!r} names an invalid default_user", template=name)
    if workdir is not None and not (
        isinstance(workdir, str) and workdir.startswith("/") and "\0" not in workdir and len(workdir) <= 4096
    ):
        raise RuntimeFailure(f"template {name!r} names an invalid workdir", template=name)
    if not (
        isinstance(env, dict)
        and len(env) <= MAX_TEMPLATE_ENV
        and all(
            isinstance(k, str)
            and _ENV_NAME_RE.fullmatch(k)
            and not k.startswith("SPACED_")
            and isinstance(v, str)
            and "\0" not in v
            and len(v) <= MAX_TEMPLATE_VALUE
            for k, v in env.items()
        )
    ):
        raise RuntimeFailure(f"template {name!r} has an invalid env", template=name)
    return user, workdir, dict(env)


def guest_environment(templates_dir: Path, name: str) -> dict[str, str]:
    """The environment a sandbox of template `name` boots its daemon with: GUEST_ENV, then the template's
    `env`, and its `default_user` / `workdir` as the daemon's settings (SPACED_USER, SPACED_WORKDIR), which
    apply to every call that names no user or cwd of its own (ADR 0057). A template without metadata (or
    without these keys) boots with GUEST_ENV alone: root in /work, as `python` always has."""
    meta = read_json(templates_dir / f"{name}.json") or {}
    user, workdir, env = _checked_defaults(name, meta)
    out = {**GUEST_ENV, **env}
    if user is not None:
        out["SPACED_USER"] = user
    if workdir is not None:
        out["SPACED_WORKDIR"] = workdir
    return out


@dataclass(frozen=True)
class Template:
    name: str
    path: Path  # read-only subvolume
    metadata: dict[str, Any]


# --- guest code -----------------------------------------------------------------------------------------
def default_guest_src() -> Path:
    """The directory holding the `space` package sources (`.../src/space`)."""
    spec = importlib.util.find_spec("space.protocol")
    if spec is None or not spec.submodule_search_locations:
        raise NotFound("cannot locate the space.protocol sources")
    return Path(next(iter(spec.submodule_search_locations))).parent


def guest_files(space_src: Path) -> list[tuple[str, bytes]]:
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


def guest_code_hash(space_src: Path | None = None, name: str = "python") -> str:
    """Hash of what a template's own layer holds: the guest code, the bootstrap and the template's recipe."""
    files = guest_files(space_src or default_guest_src())
    h = hashlib.sha256(GUEST_LAYER_VERSION.encode() + b"\0" + GUEST_BOOTSTRAP.encode() + b"\0")
    if name != "python":  # python's hash stays what it was, so existing nodes do not rebuild it
        h.update(repr(BUILTIN_TEMPLATES[name]).encode() + b"\0")
    for rel, data in files:
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


# --- guest layer ----------------------------------------------------------------------------------------
def _install_guest_code(root: Path, space_src: Path) -> int:
    lib = root / GUEST_LIB.lstrip("/")
    pkg = lib / "space"
    if pkg.exists():
        shutil.rmtree(pkg)
    size = 0
    for rel, data in guest_files(space_src):
        dst = pkg / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        os.chmod(dst, 0o644)
        size += len(data)
    # /opt/space too (made with the helper's owner-only umask): a template's users run guest code (sudo).
    ancestors = [parent for parent in lib.parents if parent.is_relative_to(root) and parent != root]
    for d in [*ancestors, lib, *(p for p in lib.rglob("*") if p.is_dir())]:
        os.chmod(d, 0o755)  # noqa: S103 - world-readable code, writable by root only
    # Compile with the template's own interpreter (its magic number and paths); the template is read-only
    # afterwards, so without this every daemon start would compile from source.
    run(
        ["chroot", str(root), GUEST_PYTHON, "-I", "-m", "compileall", "-q", "-j", "0", GUEST_LIB],
        "compileall in template",
        umask=ROOTFS_UMASK,  # __pycache__ directories readable by the guest's users
    )
    return size


def _install_template_files(root: Path, spec: BuiltinTemplate) -> int:
    size = 0
    for path, content, mode in spec.files:
        dst = root / path.lstrip("/")
        missing = [d for d in (dst.parent, *dst.parent.parents) if d.is_relative_to(root) and not d.exists()]
        dst.parent.mkdir(parents=True, exist_ok=True)
        for d in missing:  # made with the helper's owner-only umask: the template's users must enter them
            os.chmod(d, 0o755)  # noqa: S103 - world-readable directories, writable by root only
        dst.write_text(content)
        os.chmod(dst, mode)
        size += len(content)
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
    spec = BUILTIN_TEMPLATES[name]
    space_src = guest_src or default_guest_src()
    target = templates / name
    meta_path = templates / f"{name}.json"
    staging = templates / f".{name}.new"
    with flock(templates / ".lock"):
        code_hash = guest_code_hash(space_src, name)
        meta = read_json(meta_path)
        if (
            meta is not None
            and meta.get("guest_code_hash") == code_hash
            and meta.get("format") == METADATA_FORMAT
            and meta.get("base_version") == BASE_VERSION  # a new base recipe rebuilds every template on it
            and btrfs.is_subvolume(target)
            and btrfs.get_readonly(target)
        ):
            return Template(name, target, meta)
        base = ensure_base(templates, cache_dir=cache_dir, mirror=mirror, progress=progress)
        base_meta = read_json(templates / f"{BASE_NAME}.json") or {}
        parent = base
        if spec.packages:
            parent = ensure_packages(
                templates, base, name, spec.packages_version, spec.packages, cache_dir=cache_dir,
                progress=progress,
            )  # fmt: skip
            base_meta = {**base_meta, **(read_json(templates / f"{parent.name}.json") or {})}
        t0 = time.monotonic()
        discard_subvolume(staging)
        btrfs.snapshot(parent, staging, readonly=False)
        guest_size = _install_guest_code(staging, space_src) + _install_template_files(staging, spec)
        btrfs.set_readonly(staging, True)
        # Metadata goes first, then the old tree, then the new tree moves in; metadata is written last.
        meta_path.unlink(missing_ok=True)
        discard_subvolume(target)
        try:
            os.rename(staging, target)
        except OSError as exc:
            raise RuntimeFailure(f"cannot move {staging} to {target}: {exc}") from exc
        meta = {
            "format": METADATA_FORMAT,
            "name": name,
            "created": now(),
            "suite": SUITE,
            "variant": VARIANT,
            "packages": [*PACKAGES, *spec.packages],
            "base": BASE_NAME,
            "base_version": BASE_VERSION,
            "base_created": base_meta.get("created"),
            "guest_code_hash": code_hash,
            "guest_lib": GUEST_LIB,
            "guest_command": guest_command(),
            "size_bytes": int(base_meta.get("size_bytes", 0)) + guest_size,
            "subvolume_id": btrfs.subvolume_id(target),
            "builtin": True,
            "description": spec.description,
            **builtin_defaults(name),
        }
        write_json_atomic(meta_path, meta)
        progress(f"space: template {name} ready ({time.monotonic() - t0:.2f} s for the guest layer)")
        return Template(name, target, meta)
