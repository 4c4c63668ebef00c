"""The helper's template build verbs refuse hostile arguments before any side effect, never touch a
built-in template, and keep their claims (no root needed: refusals happen in validation, and the claim and
listing work on a plain directory)."""

from __future__ import annotations

import hashlib

import pytest

from space.core.ids import new_sandbox_id
from space.node.agent import template_travel
from space.node.helper.context import HelperContext
from space.node.helper.params import TemplateCommitParams
from space.node.helper.server import dispatch
from space.node.helper.template_build_verbs import IMPORTED_SUFFIX, committed_defaults
from tests.support import helper_context

ctx = helper_context.ctx  # a helper context without root

NAME = "tpl-0123456789abcdef"
HASH = hashlib.sha256(b"spec").hexdigest()


def _call(ctx: HelperContext, verb: str, args: dict[str, object]) -> dict[str, object]:
    return dispatch(ctx, {"verb": verb, "args": args}, print)  # type: ignore[no-any-return]


def _refused(answer: dict[str, object], code: str = "invalid_argument") -> None:
    assert answer["ok"] is False, answer
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == code, error


def _commit(**changes: object) -> dict[str, object]:
    args: dict[str, object] = {
        "name": NAME,
        "sandbox_id": new_sandbox_id(),
        "base": "python",
        "spec_hash": HASH,
    }
    args.update(changes)
    return args


@pytest.mark.parametrize("name", ["../x", "tpl-../x", "TPL-X", "", "a" * 64, "tpl x", ".builds", 7])
def test_hostile_names_are_refused_by_every_template_verb(ctx: HelperContext, name: object) -> None:
    _refused(_call(ctx, "template.claim", {"name": name, "sandbox_id": new_sandbox_id()}))
    _refused(_call(ctx, "template.commit", _commit(name=name)))
    _refused(_call(ctx, "template.delete", {"name": name}))


@pytest.mark.parametrize(
    "changes",
    [
        {"sandbox_id": "sb-../../etc"},
        {"base": "../python"},
        {"spec_hash": "x" * 64},
        {"workdir": "relative/dir"},
        {"workdir": "/a\x00b"},
        {"default_user": "Root"},
        {"default_user": "a;rm -rf /"},
        {"env": {"A": "x\x00y"}},
        {"env": {"1A": "x"}},
        {"start_cmd": ""},
        {"start_cmd": "a" * 5000},
        {"extra": True},
    ],
)
def test_commit_arguments_are_validated(ctx: HelperContext, changes: dict[str, object]) -> None:
    _refused(_call(ctx, "template.commit", _commit(**changes)))


def test_built_in_templates_are_never_claimed_committed_or_deleted(ctx: HelperContext) -> None:
    for name in ("python", "base"):
        _refused(_call(ctx, "template.claim", {"name": name, "sandbox_id": new_sandbox_id()}))
        _refused(_call(ctx, "template.commit", _commit(name=name)))
        _refused(_call(ctx, "template.delete", {"name": name}))


def test_a_commit_needs_its_base_and_its_build_sandbox(ctx: HelperContext) -> None:
    _refused(_call(ctx, "template.commit", _commit()), "not_found")  # no base template on this node


def test_claims_are_recorded_answered_and_dropped(ctx: HelperContext) -> None:
    first, second = new_sandbox_id(), new_sandbox_id()
    assert _call(ctx, "template.list", {})["result"] == {
        "templates": [], "claims": [], "builtin_names": ["python", "base", "browser"]
    }  # fmt: skip
    assert _call(ctx, "template.claim", {"name": NAME, "sandbox_id": first})["result"]["previous"] is None  # type: ignore[index]
    answer = _call(ctx, "template.claim", {"name": NAME, "sandbox_id": second})
    assert answer["result"]["previous"] == first  # type: ignore[index]
    listing = _call(ctx, "template.list", {})["result"]
    assert listing["claims"] == [{"name": NAME, "sandbox_id": second}]  # type: ignore[index]
    _call(ctx, "template.claim", {"name": NAME})
    assert _call(ctx, "template.list", {})["result"]["claims"] == []  # type: ignore[index]
    assert _call(ctx, "template.delete", {"name": NAME})["result"] == {"name": NAME, "existed": False}


def test_a_commit_inherits_its_base_s_defaults_under_its_own() -> None:
    image = {"env": {"PATH": "/usr/local/bin:/usr/bin", "LANG": "C.UTF-8"}, "workdir": "/app",
             "default_user": "app", "start_cmd": "not inherited"}  # fmt: skip
    params = TemplateCommitParams.model_validate(_commit())
    assert committed_defaults(image, params) == {
        "env": {"PATH": "/usr/local/bin:/usr/bin", "LANG": "C.UTF-8"},
        "workdir": "/app", "default_user": "app",
    }  # fmt: skip
    own = TemplateCommitParams.model_validate(
        _commit(
            env={"LANG": "en_US.UTF-8", "MINE": "1"}, workdir="/srv", default_user="builder", start_cmd="go"
        )
    )
    assert committed_defaults(image, own) == {
        "env": {"PATH": "/usr/local/bin:/usr/bin", "LANG": "en_US.UTF-8", "MINE": "1"},
        "workdir": "/srv", "default_user": "builder", "start_cmd": "go",
    }  # fmt: skip
    as_root = TemplateCommitParams.model_validate(_commit(default_user="root"))
    assert "default_user" not in committed_defaults(image, as_root)  # the build said root: no default user
    hostile = {"env": ["not", "a", "map"], "workdir": 7, "default_user": None}
    assert committed_defaults(hostile, params) == {"env": {}}


def test_deleting_a_template_deletes_its_imported_image(ctx: HelperContext) -> None:
    templates = ctx.layout.templates
    imported = NAME + IMPORTED_SUFFIX
    assert imported == template_travel.imported_name(NAME)  # the agent names it so
    for name in (NAME, imported, "tpl-fedcba9876543210-oci"):
        (templates / name).mkdir(parents=True)
        (templates / f"{name}.json").write_text("{}")
    assert _call(ctx, "template.delete", {"name": NAME})["result"] == {"name": NAME, "existed": True}
    left = sorted(p.name for p in templates.iterdir())
    assert left == [
        "tpl-fedcba9876543210-oci",
        "tpl-fedcba9876543210-oci.json",
    ]  # another build's image stays
    # an imported image alone (a build given up) is deleted by its own name, nothing else with it
    answer = _call(ctx, "template.delete", {"name": "tpl-fedcba9876543210-oci"})
    assert answer["result"] == {"name": "tpl-fedcba9876543210-oci", "existed": True}
    assert list(templates.iterdir()) == []
