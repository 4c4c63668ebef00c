"""Checkpoints and the template base leaving and entering a node (root helper verbs).

A full checkpoint leaves a node as three things: the read-only disk snapshot as a `btrfs send -p <base>`
delta (the guest layer and everything the sandbox wrote; the base is the same subvolume on every node,
see space.node.volumes.template_base), the runsc checkpoint image directory, and nothing else: the bundle
config is *derived* on the receiving node from the caller's validated spec (template, limits, env), never
taken from the artifact, so an artifact cannot add a mount, a capability or a hook.

Everything passes through the staging directories of space.node.helper.staging, which also owns the
only ways files the agent staged are opened.

Invariants:
- Every path is derived from validated ids (NodeLayout); the agent names no path.
- An export is complete iff its `export.json` exists (written last); a repeat returns it, an incomplete one
  is rebuilt from scratch.
- An import is repeatable after a crash at any point: a disk subvolume counts as received only once it is
  read-only with a received UUID (what `btrfs receive` sets last), otherwise it is deleted and received
  again; the image directory is moved in by one rename;
  the bundle files are rewritten every time (config last). What is already complete is kept.
- A delta is received only onto the base it was made against (its parent UUID is checked first), and
  nothing is imported for a sandbox whose runtime is alive on this node. Staged streams are opened once
  and read only through that descriptor; `btrfs_receive.receive` confines and checks them (ADR 0023).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from typing import Any

from space.core import errors
from space.node.helper import oci, staging
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import ImportParams, NoTransferParams, TransferParams
from space.node.helper.usage import write_json
from space.node.volumes import btrfs, btrfs_receive, sendstream, template_base, templates

DISK_STREAM = "disk.stream"
BASE_STREAM = "base.stream"


def base_identity(ctx: HelperContext) -> str:
    """The UUID deltas name as their parent when made against this node's template base."""
    return _base(ctx)[1]


def _base(ctx: HelperContext) -> tuple[pathlib.Path, str]:
    status = template_base.base_status(ctx.layout.templates)
    if not status["present"]:
        raise errors.NotFound(f"the template base {template_base.BASE_NAME} is not on this node")
    return ctx.layout.templates / template_base.BASE_NAME, str(status["identity"])


# -- checkpoints -----------------------------------------------------------------------------------------
def snapshot_export(ctx: HelperContext, params: TransferParams, _progress: Progress) -> dict[str, Any]:
    """Stage a full checkpoint for upload: disk.stream (send -p base) and image/<files>."""
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    image = ctx.layout.checkpoint_image(sandbox_id, snapshot_id)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    if not image.is_dir() or not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"full checkpoint {snapshot_id} of {sandbox_id} is not on this node")
    out = ctx.layout.export_dir(sandbox_id, snapshot_id)
    marker = out / "export.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        done = json.loads(marker.read_text())
        if isinstance(done, dict):
            return done
    staging.fresh_dir(ctx, out)
    base, identity = _base(ctx)
    timings: dict[str, float] = {}
    mark = time.monotonic()
    with open(out / DISK_STREAM, "wb") as f:
        btrfs_receive.send(disk, f, parent=base)
    timings["send_ms"] = (time.monotonic() - mark) * 1000
    with open(out / DISK_STREAM, "rb") as f:
        header = sendstream.read_header(f)
    if header.parent_uuid != identity:
        raise errors.RuntimeFailure(f"delta of {snapshot_id} names parent {header.parent_uuid}, not the base")
    mark = time.monotonic()
    (out / "image").mkdir()
    files = {DISK_STREAM: (out / DISK_STREAM).stat().st_size}
    for path in staging.image_files(image):
        staging.clone(path, out / "image" / path.name)
        files[f"image/{path.name}"] = path.stat().st_size
    timings["image_ms"] = (time.monotonic() - mark) * 1000
    staging.chown_tree(out, ctx.owner_uid)
    result = {
        "dir": str(out),
        "files": files,
        "metadata": {
            "format": 1,
            "kind": "full-checkpoint",
            "sandbox_id": sandbox_id,
            "snapshot_id": snapshot_id,
            "base": template_base.BASE_NAME,
            "base_version": template_base.BASE_VERSION,
            "base_identity": identity,
            "disk_stream_bytes": files[DISK_STREAM],
            "image_bytes": sum(size for name, size in files.items() if name.startswith("image/")),
        },
        "timings": timings,
    }
    write_json(marker, result, ctx.owner_uid)
    return result


def snapshot_import(ctx: HelperContext, params: ImportParams, _progress: Progress) -> dict[str, Any]:
    """Place a downloaded full checkpoint: the disk delta received onto the base, the image moved in, and
    the bundle written for the caller's spec. `sandbox.restore` then runs it."""
    sandbox_id, snapshot_id = params.sandbox_id, params.snapshot_id
    if ctx.runtimes.holder_alive(sandbox_id):
        raise errors.InvalidState(f"sandbox {sandbox_id} already runs on this node", state="running")
    staged = ctx.layout.import_dir(sandbox_id, snapshot_id)
    disk = ctx.layout.snapshot(sandbox_id, snapshot_id)
    image = ctx.layout.checkpoint_image(sandbox_id, snapshot_id)
    timings: dict[str, float] = {}
    if not _received(disk):
        _base_path, identity = _base(ctx)
        # Only a delta onto this node's base, creating exactly this snapshot, is applied (the parent check
        # raises NotFound naming both UUIDs; anything malformed or escaping is ArtifactCorrupt).
        expected = sendstream.Expected.delta(snapshot_id, {identity})
        with staging.open_staged(staged, DISK_STREAM) as stream:
            if btrfs.is_subvolume(disk):
                btrfs.delete_subvolume(disk)  # half-received by a killed import
            disk.parent.mkdir(parents=True, exist_ok=True)
            mark = time.monotonic()
            btrfs_receive.receive(stream, disk.parent, expected=expected)
            timings["receive_ms"] = (time.monotonic() - mark) * 1000
        if not _received(disk):
            raise errors.RuntimeFailure(f"receiving the disk of {snapshot_id} left no finished subvolume")
    if not image.is_dir():
        staged_image = staged / "image"
        staging.take_ownership(staged_image)
        if not staging.image_files(staged_image):
            raise errors.InvalidArgument(f"the checkpoint image of {snapshot_id} is empty")
        image.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staged_image, image)
    bundle = ctx.layout.bundle(sandbox_id)
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "limits.json").write_text(params.limits.model_dump_json())
    (bundle / "spec.json").write_text(json.dumps({"template": params.template, "env": params.env}))
    config = oci.bundle_config(
        rootfs=ctx.layout.rootfs(sandbox_id),
        init_argv=templates.guest_command(),
        init_env={**templates.guest_environment(ctx.layout.templates, params.template), **params.env},
        limits=params.limits,
    )
    oci.write_bundle_config(bundle, config)
    staging.remove(staged)
    return {"disk": str(disk), "image": str(image), "timings": timings}


def _received(disk: pathlib.Path) -> bool:
    """A finished `btrfs receive`: it sets the received UUID and the read-only flag only at its very end."""
    if not btrfs.is_subvolume(disk) or not btrfs.get_readonly(disk):
        return False
    return btrfs.subvolume_identity(disk).received_uuid is not None


# -- the template base -----------------------------------------------------------------------------------
def base_status(ctx: HelperContext, _params: NoTransferParams, _progress: Progress) -> dict[str, Any]:
    return template_base.base_status(ctx.layout.templates)


def base_export(ctx: HelperContext, _params: NoTransferParams, _progress: Progress) -> dict[str, Any]:
    out = ctx.layout.base_export_dir()
    marker = out / "export.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        done = json.loads(marker.read_text())
        if isinstance(done, dict):
            return done
    staging.fresh_dir(ctx, out)
    info = template_base.export_base(ctx.layout.templates, out / BASE_STREAM)
    staging.chown_tree(out, ctx.owner_uid)
    result = {
        "dir": str(out),
        "files": {BASE_STREAM: info["bytes"]},
        "metadata": {"format": 1, "kind": "template-base", "base": template_base.BASE_NAME,
                     "base_version": info["version"], "base_identity": info["identity"]},
        "timings": {},
    }  # fmt: skip
    write_json(marker, result, ctx.owner_uid)
    return result


def base_import(ctx: HelperContext, _params: NoTransferParams, progress: Progress) -> dict[str, Any]:
    staged = ctx.layout.base_import_dir()
    with staging.open_staged(staged, BASE_STREAM) as stream:
        result = template_base.import_base(ctx.layout.templates, stream, progress=progress)
    staging.remove(staged)
    return result
