"""Verb handlers for templates on this node: build or find one, receive one from another node, and its
warm start (space.node.helper.warm).

Invariants:
- Verbs on one template are serialised by the template's lock; adopting a warm start also takes the lock of
  the sandbox it is made from, then destroys that sandbox.
- A received template is a delta onto this node's template base that creates exactly the named template;
  its stream is opened once beneath the data directory without following any symlink (ADR 0023).
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from space.core import errors
from space.node.helper import staging, transfer
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import AdoptWarmParams, SandboxParams, TemplateParams, TemplateReceiveParams
from space.node.helper.sandbox_verbs import sandbox_destroy
from space.node.helper.warm import discard_warm, template_stamp, warm_ready
from space.node.volumes import btrfs, btrfs_receive, sendstream, templates


def template_ensure(ctx: HelperContext, params: TemplateParams, progress: Progress) -> dict[str, Any]:
    with ctx.lock(f"template:{params.name}"):
        info = templates.ensure_template(ctx.layout.fs, params.name, progress=progress)
    return {"name": params.name, "path": str(info.path), "metadata": info.metadata}


def template_receive(
    ctx: HelperContext, params: TemplateReceiveParams, _progress: Progress
) -> dict[str, Any]:
    """Install a template from a `btrfs send -p <base>` stream (how templates travel between nodes).

    The stream is opened once, beneath the data directory without following any symlink, and must be a
    delta onto this node's template base that creates exactly `params.name` (ADR 0023)."""
    stream_path = ctx.layout.confine(params.stream)
    dest = ctx.layout.template(params.name)
    with (
        ctx.lock(f"template:{params.name}"),
        staging.open_beneath(ctx.layout.data_dir.resolve(), stream_path) as stream,
    ):
        if btrfs.is_subvolume(dest) or dest.exists():
            raise errors.AlreadyExists(f"template {params.name!r} is already on this node")
        expected = sendstream.Expected.delta(params.name, {transfer.base_identity(ctx)})
        try:
            btrfs_receive.receive(stream, ctx.layout.templates, expected=expected)
        except errors.ArtifactCorrupt as exc:
            raise errors.InvalidArgument(exc.message, **{**exc.details, "field": "stream"}) from exc
    return {"name": params.name, "path": str(dest)}


def template_warm_status(ctx: HelperContext, params: TemplateParams, _progress: Progress) -> dict[str, Any]:
    return {"name": params.name, "ready": warm_ready(ctx, params.name)}


def template_adopt_warm(ctx: HelperContext, params: AdoptWarmParams, progress: Progress) -> dict[str, Any]:
    """Turn a full checkpoint of a freshly booted sandbox of the template into the template's warm start,
    then destroy that sandbox. warm.json is written last: a half-adopted warm start is never used."""
    image = ctx.layout.checkpoint_image(params.sandbox_id, params.snapshot_id)
    disk = ctx.layout.snapshot(params.sandbox_id, params.snapshot_id)
    if not image.is_dir() or not btrfs.is_subvolume(disk):
        raise errors.NotFound(f"checkpoint {params.snapshot_id} of {params.sandbox_id} is not on this node")
    with ctx.lock(f"template:{params.name}"):
        warm = ctx.layout.warm(params.name)
        discard_warm(ctx, params.name)
        warm.mkdir(parents=True)
        with ctx.lock(params.sandbox_id):
            ctx.runtimes.stop(params.sandbox_id)
            image.rename(warm / "image")
            btrfs.snapshot(disk, warm / "rootfs", readonly=True)  # a read-only subvolume cannot be moved
            shutil.copy2(ctx.layout.bundle(params.sandbox_id) / "config.json", warm / "config.json")
            sandbox_destroy(ctx, SandboxParams(sandbox_id=params.sandbox_id), progress)
        (warm / "warm.json").write_text(json.dumps({"template_stamp": template_stamp(ctx, params.name)}))
    return {"name": params.name, "ready": True}
