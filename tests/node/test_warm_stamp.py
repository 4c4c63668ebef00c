"""The warm start's stamp (space.node.helper.warm): a warm checkpoint is used only by the runtime that made
it, so a runsc upgrade or a platform change rebuilds it instead of failing every create on a refusal."""

from __future__ import annotations

import dataclasses

from space.node.helper import warm
from space.node.helper.context import HelperContext
from tests.support import helper_context

ctx = helper_context.ctx  # a helper context without root


def test_the_stamp_follows_the_template_and_the_runtime(ctx: HelperContext) -> None:
    meta = ctx.layout.templates / "python.json"
    meta.parent.mkdir(parents=True, exist_ok=True)
    assert warm.template_stamp(ctx, "python") == ""  # no template, no stamp: never warm
    meta.write_text('{"built": 1}')
    stamp = warm.template_stamp(ctx, "python")
    assert stamp and stamp == warm.template_stamp(ctx, "python")
    ctx.runsc = dataclasses.replace(ctx.runsc, platform="systrap")
    assert warm.template_stamp(ctx, "python") not in {"", stamp}
    ctx.runsc = dataclasses.replace(ctx.runsc, platform="ptrace")
    assert warm.template_stamp(ctx, "python") == stamp
    meta.write_text('{"built": 2}')
    assert warm.template_stamp(ctx, "python") != stamp
