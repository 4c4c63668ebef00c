"""The root helper's side of user templates travelling between nodes through object storage
(docs/adr/0056-oci-import-and-template-travel.md): a complete user template leaves as a `btrfs send -p
<template base>` delta (as checkpoints do, ADR 0023) and enters by a confined receive of that delta.

Invariants:
- Only user templates (`tpl-...`) travel this way; built-ins have their own base (space.node.helper.transfer).
- An export is complete iff its `export.json` exists (written last); a repeat returns it while it names the
  template's current metadata (a deleted and rebuilt namesake is exported afresh).
- A received template is a delta onto this node's template base creating exactly `templates/<name>`, read
  from the agent's staged stream opened once without following symlinks; its metadata (what the publishing
  node wrote, checked here field by field) is written last, so a killed import leaves a tree without
  metadata, which the next import (or build) discards.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from pydantic import Field

from space.core import errors
from space.node.helper import staging
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import Params, TemplateName
from space.node.helper.transfer import base_identity
from space.node.helper.usage import write_json
from space.node.volumes import btrfs, btrfs_receive, sendstream, template_base
from space.node.volumes.template_files import discard_subvolume, now, read_json, write_json_atomic

STREAM = "template.stream"
USER_PREFIX = "tpl-"
MAX_METADATA = 64 * 1024
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class TemplateTravelParams(Params):
    name: TemplateName


class TemplateImportParams(Params):
    name: TemplateName
    metadata_json: str = Field(max_length=MAX_METADATA, description="the published template's metadata")


def _user_template(name: str) -> None:
    if not name.startswith(USER_PREFIX):
        raise errors.InvalidArgument(f"only user templates ({USER_PREFIX}...) travel this way", field="name")


def template_export(ctx: HelperContext, params: TemplateTravelParams, _progress: Progress) -> dict[str, Any]:
    """Stage `template.stream` (send -p base) of a complete user template for upload."""
    name = params.name
    _user_template(name)
    out = staging.template_dir(ctx, "template-export", name)
    marker = out / "export.json"
    with ctx.lock(f"template:{name}"):
        meta = read_json(ctx.layout.templates / f"{name}.json")
        target = ctx.layout.template(name)
        if meta is None or not btrfs.is_subvolume(target) or not btrfs.get_readonly(target):
            raise errors.NotFound(f"template {name!r} is not on this node", template=name)
        with contextlib.suppress(OSError, json.JSONDecodeError, KeyError, TypeError):
            done = json.loads(marker.read_text())
            if done["metadata"]["template_metadata"] == meta:  # this very template (not a deleted namesake)
                return dict(done)
        identity = base_identity(ctx)
        staging.fresh_dir(ctx, out)
        with open(out / STREAM, "wb") as f:
            btrfs_receive.send(target, f, parent=ctx.layout.templates / template_base.BASE_NAME)
    with open(out / STREAM, "rb") as f:
        if sendstream.read_header(f).parent_uuid != identity:
            raise errors.RuntimeFailure(f"the delta of template {name} does not name the base as its parent")
    size = (out / STREAM).stat().st_size
    staging.chown_tree(out, ctx.owner_uid)
    result = {
        "dir": str(out),
        "files": {STREAM: size},
        "metadata": {"format": 1, "kind": "user-template", "template": name, "base": template_base.BASE_NAME,
                     "base_identity": identity, "stream_bytes": size, "template_metadata": meta},
        "timings": {},
    }  # fmt: skip
    write_json(marker, result, ctx.owner_uid)
    return result


def checked_metadata(name: str, raw: str) -> dict[str, Any]:
    """The published metadata, if it describes `name` and its interface fields are well formed."""
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise errors.InvalidArgument("template metadata is not JSON", field="metadata_json") from exc
    if not isinstance(meta, dict) or meta.get("name") != name:
        raise errors.InvalidArgument(f"the metadata does not describe template {name}", field="metadata_json")
    env = meta.get("env", {})
    user, workdir, start = meta.get("default_user"), meta.get("workdir"), meta.get("start_cmd")
    problems = [
        not isinstance(env, dict)
        or len(env) > 256
        or not all(isinstance(v, str) and _ENV_KEY.fullmatch(k) and "\x00" not in v for k, v in env.items()),
        user is not None and not (isinstance(user, str) and _USER.fullmatch(user)),
        workdir is not None
        and not (isinstance(workdir, str) and workdir.startswith("/") and "\x00" not in workdir),
        start is not None and not (isinstance(start, str) and len(start) <= 4096 and "\x00" not in start),
    ]
    if any(problems):
        raise errors.InvalidArgument(f"the metadata of template {name} is malformed", field="metadata_json")
    return meta


def template_import(ctx: HelperContext, params: TemplateImportParams, _progress: Progress) -> dict[str, Any]:
    """Receive a staged user template delta onto the base, then write its metadata (last)."""
    name = params.name
    _user_template(name)
    meta = checked_metadata(name, params.metadata_json)
    staged = staging.template_dir(ctx, "template-import", name)
    target = ctx.layout.template(name)
    meta_path = ctx.layout.templates / f"{name}.json"
    with ctx.lock(f"template:{name}"):
        if meta_path.exists():
            staging.remove(staged)
            return {"name": name, "already": True}
        discard_subvolume(target)  # received or built half-way by a killed run (no metadata)
        expected = sendstream.Expected.delta(name, {base_identity(ctx)})
        with staging.open_staged(staged, STREAM) as stream:
            try:
                btrfs_receive.receive(stream, ctx.layout.templates, expected=expected)
            except errors.ArtifactCorrupt as exc:
                raise errors.InvalidArgument(exc.message, **{**exc.details, "field": "stream"}) from exc
        if not btrfs.is_subvolume(target) or not btrfs.get_readonly(target):
            discard_subvolume(target)
            raise errors.RuntimeFailure(f"receiving template {name} left no finished subvolume")
        meta = {**meta, "received": now(), "subvolume_id": btrfs.subvolume_id(target)}
        write_json_atomic(meta_path, meta)
        staging.remove(staged)
    return {"name": name, "already": False, "metadata": meta}
