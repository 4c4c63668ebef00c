"""A template's warm start: a checkpoint of a freshly booted sandbox of the template, restored instead of
booted when a sandbox is created with `warm`.

Invariants:
- `templates/<name>.warm/warm.json` is written last, and names the stamp of the template build (and network
  mode) it was made from: a warm start is used only while both are unchanged; a half-adopted one never is.
"""

from __future__ import annotations

import hashlib
import json
import shutil

from space.node.helper.context import HelperContext
from space.node.volumes import btrfs


def template_stamp(ctx: HelperContext, template: str) -> str:
    """Changes whenever the template is rebuilt (its metadata file is rewritten last on every build)."""
    meta = ctx.layout.templates / f"{template}.json"
    try:
        # A checkpoint made with networking restores only with networking (and the reverse), and only on
        # the runtime that made it: a runsc upgrade rebuilds the warm start instead of refusing it.
        mode = b"" if ctx.network is None else b"network=sandbox"
        runtime = json.dumps(ctx.runsc.descriptor(), sort_keys=True).encode()
        return hashlib.sha256(meta.read_bytes() + mode + runtime).hexdigest()
    except OSError:
        return ""


def warm_ready(ctx: HelperContext, template: str) -> bool:
    try:
        info = json.loads((ctx.layout.warm(template) / "warm.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(info.get("template_stamp")) and info.get("template_stamp") == template_stamp(ctx, template)


def discard_warm(ctx: HelperContext, template: str) -> None:
    warm = ctx.layout.warm(template)
    if not warm.exists():
        return
    (warm / "warm.json").unlink(missing_ok=True)
    if btrfs.is_subvolume(warm / "rootfs"):
        btrfs.delete_subvolume(warm / "rootfs")
    shutil.rmtree(warm, ignore_errors=True)
