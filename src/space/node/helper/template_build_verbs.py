"""Verb handlers for user templates (docs/adr/0054-template-build.md): commit a stopped build sandbox's root
filesystem as a read-only template, list and delete user templates, and the build claim that lets a build
killed at any point be cleaned up by the next one.

Invariants:
- Built-in templates (space.node.volumes.templates.TEMPLATE_NAMES) are never committed over nor deleted
  here (InvalidArgument); they are ensure_template's.
- A user template is complete iff its metadata file `templates/<name>.json` exists: it is written last,
  atomically, after the read-only subvolume `templates/<name>` is in place; delete removes it first. So a
  reader never pairs metadata with a missing or half-made tree.
- The committed tree is a read-only snapshot of the build sandbox's root filesystem, taken after its runtime
  was stopped (no process writes into it while it is copied); it is moved in from `.<name>.new` in the same
  directory (a read-only subvolume can be renamed only within its parent).
- A claim (`templates/.builds/<name>.json`: the build sandbox's id) exists from before the build sandbox is
  created until the template is committed or the build is given up. Taking a claim discards what a killed
  build of that name left (its staging subvolume, a subvolume without metadata) and answers the previous
  claim's sandbox, which the agent destroys.
- Verbs on one template are serialised by the template's lock (the same key as template_verbs').
- A committed template inherits its base's `env`, `workdir` and `default_user` (an image's ENV, WORKDIR
  and USER for an OCI build, ADR 0056) under the build's own (the build wins; a build naming `root` as its
  user drops an inherited default user); never the base's start command (it did not run in the build).
- Deleting user template `name` deletes `<name>-oci` (IMPORTED_SUFFIX: the image an OCI build of `name`
  was unpacked into; space.node.agent.template_travel.imported_name) with it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from space.core import errors
from space.core.ids import TEMPLATE_NAME_MAX_LENGTH, TEMPLATE_NAME_PATTERN
from space.node.helper.context import HelperContext, Progress
from space.node.helper.params import NoParams, TemplateClaimParams, TemplateCommitParams, TemplateParams
from space.node.helper.warm import discard_warm
from space.node.volumes import btrfs, mirror, template_base, templates
from space.node.volumes.template_files import (
    METADATA_FORMAT,
    discard_subvolume,
    now,
    read_json,
    tree_size,
    write_json_atomic,
)

_NAME = re.compile(TEMPLATE_NAME_PATTERN)
#: What an OCI build's imported image template is named after the built one (template_travel.imported_name).
IMPORTED_SUFFIX = "-oci"
#: The defaults a template inherits from its base (under the build's own).
INHERITED = ("default_user", "workdir")


def _refuse_builtin(name: str, what: str) -> None:
    if name in templates.TEMPLATE_NAMES:
        raise errors.InvalidArgument(f"cannot {what} built-in template {name!r}", field="name")


def _claim_path(ctx: HelperContext, name: str) -> Path:
    return ctx.layout.templates / ".builds" / f"{name}.json"


def _meta_path(ctx: HelperContext, name: str) -> Path:
    return ctx.layout.templates / f"{name}.json"


def _staging(ctx: HelperContext, name: str) -> Path:
    return ctx.layout.templates / f".{name}.new"


def template_claim(ctx: HelperContext, params: TemplateClaimParams, _progress: Progress) -> dict[str, Any]:
    """Record `sandbox_id` as the build sandbox of `name` (None: drop the claim); answers the previous
    claim's sandbox id, and discards what a killed build of `name` left behind."""
    _refuse_builtin(params.name, "build")
    with ctx.lock(f"template:{params.name}"):
        path = _claim_path(ctx, params.name)
        previous = read_json(path) or {}
        discard_subvolume(_staging(ctx, params.name))
        target = ctx.layout.template(params.name)
        if not _meta_path(ctx, params.name).exists() and os.path.lexists(target):
            discard_subvolume(target)  # a commit killed before its metadata: never complete
        if params.sandbox_id is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_json_atomic(path, {"name": params.name, "sandbox_id": params.sandbox_id, "at": now()})
    prior = previous.get("sandbox_id")
    return {"name": params.name, "previous": prior if isinstance(prior, str) else None}


def _base_metadata(ctx: HelperContext, base: str) -> dict[str, Any]:
    meta = read_json(_meta_path(ctx, base))
    if meta is None:
        raise errors.NotFound(f"template {base!r} is not on this node", template=base)
    return meta


def template_commit(ctx: HelperContext, params: TemplateCommitParams, _progress: Progress) -> dict[str, Any]:
    """Snapshot the stopped build sandbox's root filesystem read-only as `templates/<name>`, then write its
    metadata (last). AlreadyExists if the template is complete already."""
    _refuse_builtin(params.name, "commit")
    base_meta = _base_metadata(ctx, params.base)
    rootfs = ctx.layout.rootfs(params.sandbox_id)
    with ctx.lock(f"template:{params.name}"):
        target = ctx.layout.template(params.name)
        meta_path = _meta_path(ctx, params.name)
        if meta_path.exists():
            raise errors.AlreadyExists(f"template {params.name!r} is already on this node")
        staging = _staging(ctx, params.name)
        discard_subvolume(staging)
        discard_subvolume(target)  # no metadata: a killed commit's tree
        with ctx.lock(params.sandbox_id):
            if not btrfs.is_subvolume(rootfs):
                raise errors.NotFound(f"build sandbox {params.sandbox_id} is not on this node")
            ctx.runtimes.stop(params.sandbox_id)  # nothing writes into the tree while it is copied
            btrfs.snapshot(rootfs, staging, readonly=True)
        try:
            os.rename(staging, target)
        except OSError as exc:
            raise errors.RuntimeFailure(f"cannot move {staging} to {target}: {exc}") from exc
        meta = {
            "format": METADATA_FORMAT,
            "name": params.name,
            "created": now(),
            "builtin": False,
            "from": params.base,
            "spec_hash": params.spec_hash,
            # The guest code in the tree is the base template's (the build never touches /opt/space).
            "guest_code_hash": base_meta.get("guest_code_hash"),
            "guest_lib": base_meta.get("guest_lib", templates.GUEST_LIB),
            "guest_command": templates.guest_command(),
            "base": base_meta.get("base"),
            "base_version": base_meta.get("base_version"),
            "size_bytes": tree_size(target),
            "subvolume_id": btrfs.subvolume_id(target),
            **committed_defaults(base_meta, params),
        }
        write_json_atomic(meta_path, meta)
        _claim_path(ctx, params.name).unlink(missing_ok=True)
    return {"name": params.name, "path": str(target), "metadata": meta}


def committed_defaults(base_meta: dict[str, Any], params: TemplateCommitParams) -> dict[str, Any]:
    """The metadata keys env, default_user, workdir, start_cmd of a template committed on a base with
    `base_meta`: the base's env, default user and workdir under the build's own (see the invariants)."""
    env = base_meta.get("env")
    base_env = {k: v for k, v in env.items() if isinstance(v, str)} if isinstance(env, dict) else {}
    out: dict[str, Any] = {"env": {**base_env, **params.env}}
    out.update({key: base_meta[key] for key in INHERITED if isinstance(base_meta.get(key), str)})
    for key in ("default_user", "workdir", "start_cmd"):
        value = getattr(params, key)
        if value is not None:
            out[key] = value
    if out.get("default_user") == "root":
        del out["default_user"]  # root is what no default user means
    return out


def template_delete(ctx: HelperContext, params: TemplateParams, _progress: Progress) -> dict[str, Any]:
    """Remove user template `name` (and `<name>-oci`, its OCI build's imported image): metadata first, then
    its warm start and tree. Sandboxes made from it keep working (each is a snapshot of its own)."""
    _refuse_builtin(params.name, "delete")
    existed = _delete(ctx, params.name)
    imported = params.name + IMPORTED_SUFFIX
    if not params.name.endswith(IMPORTED_SUFFIX) and _valid_name(imported):
        _delete(ctx, imported)
    return {"name": params.name, "existed": existed}


def _delete(ctx: HelperContext, name: str) -> bool:
    with ctx.lock(f"template:{name}"):
        meta_path = _meta_path(ctx, name)
        target = ctx.layout.template(name)
        existed = meta_path.exists() or os.path.lexists(target)
        meta_path.unlink(missing_ok=True)
        discard_warm(ctx, name)
        discard_subvolume(target)
        discard_subvolume(_staging(ctx, name))
    return existed


def _valid_name(name: str) -> bool:
    return len(name) <= TEMPLATE_NAME_MAX_LENGTH and _NAME.fullmatch(name) is not None


def template_list(ctx: HelperContext, _params: NoParams, _progress: Progress) -> dict[str, Any]:
    """The complete templates on this node (built-in and user: metadata present, read-only tree) and the
    open build claims."""
    root = ctx.layout.templates
    held: list[dict[str, Any]] = []
    for meta_path in sorted(root.glob("*.json")) if root.is_dir() else []:
        name = meta_path.stem
        if not _valid_name(name):
            continue  # `.base-*` layers and anything else that is not a template name
        meta = read_json(meta_path)
        target = ctx.layout.template(name)
        if meta is None or not btrfs.is_subvolume(target):
            continue
        held.append({"name": name, "builtin": name in templates.TEMPLATE_NAMES, "metadata": meta})
    claims: list[dict[str, str]] = []
    for path in sorted((root / ".builds").glob("*.json")) if (root / ".builds").is_dir() else []:
        claim = read_json(path) or {}
        if _valid_name(path.stem) and isinstance(claim.get("sandbox_id"), str):
            claims.append({"name": path.stem, "sandbox_id": str(claim["sandbox_id"])})
    return {"templates": held, "claims": claims, "builtin_names": list(templates.TEMPLATE_NAMES)}


def template_sources(_ctx: HelperContext, _params: NoParams, _progress: Progress) -> dict[str, Any]:
    """The Debian archive of this machine's apt sources and the suite of the template base, for the
    package steps of builds (the agent reads no system configuration itself)."""
    return {"mirror": mirror.find_mirror(), "suite": template_base.SUITE}
