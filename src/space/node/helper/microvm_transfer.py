"""MicroVM checkpoints leaving and entering a node through object storage (root helper verbs; ADR 0081).

A microVM's full checkpoint (space.node.helper.microvm: `memory`, `disk.img`, `meta.json` of one stopped
moment) leaves the node as three staged files under `image/`, uploaded by the agent exactly like a gVisor
checkpoint (same artifact format, same encryption):
    image/memory     QEMU's migration stream of the stopped guest (RAM and device state)
    image/disk.img   the guest's raw disk at that moment, whole (sparse on disk; zeros compress to nothing)
    image/meta.json  accelerator, machine (memory, vCPUs), guest kernel release, template, both sizes

Invariants:
- Every path is derived from validated ids (NodeLayout, MicroVMs); the agent names no path.
- An export is complete iff its `export.json` exists (written last); a repeat returns it.
- Everything an import reads is hostile (it came from object storage through the agent): the staged
  `image/` directory becomes root's before it is read and is then only used through one descriptor opened
  without following links; it must hold exactly the three names, as regular files. meta.json is at most
  META_MAX_BYTES, a JSON object whose fields have the exact types and bounds below. Accelerator, machine
  and guest kernel must be this node's template's (RuntimeIncompatible otherwise: QEMU cannot load a
  stream of another machine, and the memory holds the kernel that runs). The disk must be its recorded
  size, a whole number of sectors and at most MAX_DISK_BYTES; the memory image its recorded size, at most
  the guest's RAM plus a margin, and must start with QEMU's migration file header naming the microvm
  machine (the stream is input to QEMU's migration parser: ADR 0081 names its fuzz target).
- The imported checkpoint's meta.json is this node's template's, never the artifact's (like runsc's bundle
  config, derived, not taken). The checkpoint directory appears by one rename once complete; a repeat
  finds it. A refused import leaves nothing: neither the staged files nor a checkpoint directory.
- Nothing is imported for a sandbox whose QEMU runs on this node.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import stat
import struct
import time
from typing import Any

from space.core import errors
from space.node.helper import staging
from space.node.helper.context import HelperContext, Progress
from space.node.helper.microvm import MicroVMs
from space.node.helper.params import Params, SandboxId, SnapshotId, TemplateName
from space.node.helper.usage import write_json
from space.node.volumes.template_files import run

MEMORY, DISK, META = "memory", "disk.img", "meta.json"
STAGED_NAMES = frozenset({MEMORY, DISK, META})
META_MAX_BYTES = 64 * 1024
META_FORMAT = 1
MAX_DISK_BYTES = 64 << 30
#: The migration stream of a guest with M MiB of RAM: at most every page with its 8-byte header, plus the
#: device state; zero pages take a header only, so real images are far smaller.
MEMORY_MARGIN_BYTES = 64 << 20
#: QEMU_VM_FILE_MAGIC "QEVM", QEMU_VM_FILE_VERSION 3, then QEMU_VM_CONFIGURATION (0x07) with the machine
#: type as a length-prefixed (be32) string: migration/savevm.c.
MIGRATION_HEADER = b"QEVM" + struct.pack(">I", 3)
CONFIGURATION_SECTION = 0x07
MACHINE = b"microvm"
ACCELERATORS = frozenset({"kvm", "tcg"})
_TEXT_MAX = 128
_TEXT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]*")  # accelerator, kernel release, template name


class MicrovmTransferParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId


class MicrovmImportParams(Params):
    sandbox_id: SandboxId
    snapshot_id: SnapshotId
    template: TemplateName


def _vms(ctx: HelperContext) -> MicroVMs:
    return MicroVMs(ctx.layout, ctx.owner_uid)


# -- export ----------------------------------------------------------------------------------------------
def microvm_export(ctx: HelperContext, params: MicrovmTransferParams, _progress: Progress) -> dict[str, Any]:
    """Stage full checkpoint `snapshot_id` for upload: image/{memory,disk.img,meta.json}, reflinked."""
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    source = _vms(ctx).checkpoint_dir(sandbox_id, snapshot_id)
    if not all((source / name).is_file() for name in STAGED_NAMES):
        raise errors.NotFound(f"full checkpoint {snapshot_id} of {sandbox_id} is not on this node")
    out = ctx.layout.export_dir(sandbox_id, snapshot_id)
    marker = out / "export.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        done = json.loads(marker.read_text())
        if isinstance(done, dict):
            return done
    staging.fresh_dir(ctx, out)
    mark = time.monotonic()
    image = out / "image"
    image.mkdir()
    for name in (MEMORY, DISK):
        staging.clone(source / name, image / name)
    saved = json.loads((source / META).read_text())
    described = {
        "format": META_FORMAT,
        "accel": saved["accel"],
        "memory_mb": saved["memory_mb"],
        "vcpus": saved["vcpus"],
        "kernel": saved["kernel"],
        "template": saved["template"],
        "memory_bytes": (image / MEMORY).stat().st_size,
        "disk_bytes": (image / DISK).stat().st_size,
    }
    (image / META).write_text(json.dumps(described, sort_keys=True))
    files = {f"image/{name}": (image / name).stat().st_size for name in sorted(STAGED_NAMES)}
    staging.chown_tree(out, ctx.owner_uid)
    result = {
        "dir": str(out),
        "files": files,
        "metadata": {
            "format": 1,
            "kind": "full-checkpoint",
            "sandbox_id": sandbox_id,
            "snapshot_id": snapshot_id,
            "microvm": {k: described[k] for k in ("accel", "memory_mb", "vcpus", "kernel")},
            "image_bytes": described["memory_bytes"],
            "disk_bytes": described["disk_bytes"],
        },
        "timings": {"stage_ms": (time.monotonic() - mark) * 1000},
    }
    write_json(marker, result, ctx.owner_uid)
    return result


# -- import ----------------------------------------------------------------------------------------------
def microvm_import(ctx: HelperContext, params: MicrovmImportParams, _progress: Progress) -> dict[str, Any]:
    """Take in a downloaded microVM checkpoint as `snapshot_id` of `sandbox_id` (then microvm.restore runs
    it), after checking every staged byte it relies on; see the module invariants."""
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    vms = _vms(ctx)
    target = vms.checkpoint_dir(sandbox_id, snapshot_id)
    staged = ctx.layout.import_dir(sandbox_id, snapshot_id)
    if (target / META).is_file():  # a repeat after the rename: already imported
        staging.remove(staged)
        return {"checkpoint": str(target), "timings": {}}
    if vms.status(sandbox_id) != "absent":
        raise errors.InvalidState(f"sandbox {sandbox_id} already runs on this node", state="running")
    build = target.with_name(f".import-{snapshot_id}")
    mark = time.monotonic()
    try:
        local = _local_template(vms, params.template)
        staged_image = staged / "image"
        staging.take_ownership(staged_image)
        dir_fd = _open_owned_dir(staged_image)
        try:
            described = _read_meta(dir_fd)
            _check_compatible(described, local, params.template, vms.accel)
            _check_disk(dir_fd, described)
            _check_memory(dir_fd, described)
            with contextlib.suppress(FileNotFoundError):
                _remove_tree(build)
            build.mkdir(parents=True)
            for name in (MEMORY, DISK):
                os.rename(name, build / name, src_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        # The download wrote the disk's holes as zeros: make them holes again (the disk costs what it holds).
        run(["fallocate", "--dig-holes", str(build / DISK)], "fallocate --dig-holes of an imported disk")
        (build / META).write_text(json.dumps({**local, "template": params.template}))
        os.rename(build, target)
    except BaseException:
        _remove_tree(build)
        with contextlib.suppress(OSError):
            build.parent.rmdir()  # only if nothing else of the sandbox is there
        raise
    finally:
        staging.remove(staged)
    return {"checkpoint": str(target), "timings": {"import_ms": (time.monotonic() - mark) * 1000}}


def _remove_tree(path: pathlib.Path) -> None:
    staging.remove(path)


def _local_template(vms: MicroVMs, template: str) -> dict[str, Any]:
    """This node's microVM checkpoint metadata of `template` (what an imported checkpoint must match)."""
    if not vms.template_ready(template):
        raise errors.NotFound(f"microVM template {template!r} is not on this node", template=template)
    meta = json.loads((vms.template_dir(template) / META).read_text())
    if not isinstance(meta, dict):
        raise errors.RuntimeFailure(f"the microVM metadata of template {template!r} is not an object")
    return meta


def _open_owned_dir(path: pathlib.Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise errors.RuntimeFailure(f"staged {path.name} is not root's own after taking it over")
    names = set(os.listdir(fd))
    if names != STAGED_NAMES:
        os.close(fd)
        raise _corrupt(f"holds {sorted(names)[:8]!r}, not exactly {sorted(STAGED_NAMES)}", "entries")
    for name in names:
        if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            os.close(fd)
            raise _corrupt(f"entry {name!r} is not a regular file", "entries")
    return fd


def _corrupt(what: str, reason: str) -> errors.ArtifactCorrupt:
    return errors.ArtifactCorrupt(f"the microVM checkpoint {what}", part="image", reason=reason)


def _read_meta(dir_fd: int) -> dict[str, Any]:
    fd = os.open(META, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(META_MAX_BYTES + 1)
    if len(raw) > META_MAX_BYTES:
        raise _corrupt(f"meta.json is larger than {META_MAX_BYTES} bytes", "meta")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _corrupt("meta.json is not JSON", "meta") from exc
    return parse_meta(value)


def parse_meta(value: object) -> dict[str, Any]:
    """The checkpoint description an artifact carries, with every field checked (ArtifactCorrupt)."""
    if not isinstance(value, dict):
        raise _corrupt("meta.json is not an object", "meta")
    fields: dict[str, tuple[type, int, int]] = {
        "format": (int, META_FORMAT, META_FORMAT),
        "memory_mb": (int, 128, 65536),
        "vcpus": (int, 1, 64),
        "memory_bytes": (int, len(MIGRATION_HEADER), (65536 << 20) + MEMORY_MARGIN_BYTES),
        "disk_bytes": (int, 512, MAX_DISK_BYTES),
        "accel": (str, 1, _TEXT_MAX),
        "kernel": (str, 1, _TEXT_MAX),
        "template": (str, 1, _TEXT_MAX),
    }
    if set(value) != set(fields):
        raise _corrupt("meta.json does not hold exactly the expected fields", "meta")
    for name, (kind, low, high) in fields.items():
        item = value[name]
        if type(item) is not kind:  # bool is not an int here
            raise _corrupt(f"meta.json field {name} is not a {kind.__name__}", "meta")
        size = item if isinstance(item, int) else len(str(item))
        if not low <= size <= high or (isinstance(item, str) and _TEXT.fullmatch(item) is None):
            raise _corrupt(f"meta.json field {name} is out of bounds", "meta")
    return dict(value)


def _check_compatible(described: dict[str, Any], local: dict[str, Any], template: str, accel: str) -> None:
    if described["template"] != template:
        raise errors.InvalidArgument("the checkpoint is of another template", field="template")
    if described["accel"] not in ACCELERATORS:
        raise _corrupt("names an unknown accelerator", "meta")
    for name, have in (("accel", accel), ("memory_mb", local.get("memory_mb")), ("vcpus", local.get("vcpus")),
                       ("kernel", local.get("kernel"))):  # fmt: skip
        if described[name] != have:
            problem = (
                f"the checkpoint's {name} is {str(described[name])[:48]!r}; this node's is {str(have)[:48]!r}"
            )
            raise errors.RuntimeIncompatible(
                f"microVM checkpoint cannot be restored on this node: {problem}", reason=problem, field=name
            )


def _check_disk(dir_fd: int, described: dict[str, Any]) -> None:
    size = os.stat(DISK, dir_fd=dir_fd, follow_symlinks=False).st_size
    if size != described["disk_bytes"] or size % 512:
        raise _corrupt(f"disk is {size} bytes, not the {described['disk_bytes']} recorded", "disk_size")


def _check_memory(dir_fd: int, described: dict[str, Any]) -> None:
    size = os.stat(MEMORY, dir_fd=dir_fd, follow_symlinks=False).st_size
    bound = (described["memory_mb"] << 20) + (described["memory_mb"] << 20) // 256 + MEMORY_MARGIN_BYTES
    if size != described["memory_bytes"] or size > bound:
        raise _corrupt(f"memory image is {size} bytes, not the {described['memory_bytes']} recorded "
                       f"(at most {bound})", "memory_size")  # fmt: skip
    fd = os.open(MEMORY, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        head = f.read(len(MIGRATION_HEADER) + 5 + len(MACHINE))
    check_memory_header(head)


def check_memory_header(head: bytes) -> None:
    """ArtifactCorrupt unless `head` starts a QEMU migration file of the microvm machine."""
    if not head.startswith(MIGRATION_HEADER):
        raise _corrupt("memory image is not a QEMU migration stream (header)", "memory_header")
    rest = head[len(MIGRATION_HEADER) :]
    if rest[:1] != bytes([CONFIGURATION_SECTION]) or rest[5 : 5 + len(MACHINE)] != MACHINE:
        raise _corrupt("memory image is not of a microvm machine", "memory_header")
    if struct.unpack(">I", rest[1:5])[0] != len(MACHINE):
        raise _corrupt("memory image is not of a microvm machine", "memory_header")
