"""The built-in template table and how a template's defaults become the daemon's boot environment
(space.node.volumes.templates, ADR 0057), without a node: metadata is hostile input until checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from space.core.errors import RuntimeFailure
from space.node.volumes import templates


def _environment(tmp_path: Path, meta: dict[str, Any] | None) -> dict[str, str]:
    if meta is not None:
        (tmp_path / "t.json").write_text(json.dumps(meta))
    return templates.guest_environment(tmp_path, "t")


def test_the_built_ins_and_their_defaults() -> None:
    assert templates.TEMPLATE_NAMES == ("python", "base")
    assert templates.builtin_defaults("python") == {}
    assert templates.builtin_defaults("base") == {
        "default_user": "user",
        "workdir": "/home/user",
        "env": {"HOME": "/home/user", "USER": "user", "LOGNAME": "user"},
    }
    files = {path: mode for path, _content, mode in templates.BUILTIN_TEMPLATES["base"].files}
    assert files == {"/etc/sudoers.d/user": 0o440, "/usr/local/bin/sudo": 0o755}
    assert "sudo_client.py" in templates.SUDO_WRAPPER and templates.SUDO_WRAPPER.startswith("#!/bin/sh\n")


def test_python_s_hash_ignores_the_table_and_base_s_follows_its_recipe() -> None:
    python, base = templates.guest_code_hash(name="python"), templates.guest_code_hash(name="base")
    assert python != base


def test_defaults_become_the_daemon_s_settings(tmp_path: Path) -> None:
    plain = _environment(tmp_path, None)
    assert plain == templates.GUEST_ENV  # no metadata: root in /work, as python always was
    env = _environment(tmp_path, {**templates.builtin_defaults("base"), "format": 1})
    assert env["SPACED_USER"] == "user" and env["SPACED_WORKDIR"] == "/home/user"
    assert (env["HOME"], env["USER"], env["PATH"]) == ("/home/user", "user", templates.GUEST_ENV["PATH"])
    assert _environment(tmp_path, {"default_user": "1000"})["SPACED_USER"] == "1000"


@pytest.mark.parametrize(
    "meta",
    [
        {"default_user": "bad user"},
        {"default_user": "-rf"},
        {"default_user": 1000},
        {"default_user": "x" * 65},
        {"workdir": "relative/dir"},
        {"workdir": "/a\0b"},
        {"workdir": "/" + "a" * 5000},
        {"env": ["HOME"]},
        {"env": {"A=B": "c"}},
        {"env": {"SPACED_USER": "root"}},  # the daemon's own settings come from the keys above only
        {"env": {"K": 1}},
        {"env": {"K": "a\0b"}},
        {"env": {f"K{i}": "v" for i in range(templates.MAX_TEMPLATE_ENV + 1)}},
        {"env": {"K": "v" * (templates.MAX_TEMPLATE_VALUE + 1)}},
    ],
)
def test_hostile_metadata_is_refused(tmp_path: Path, meta: dict[str, Any]) -> None:
    with pytest.raises(RuntimeFailure):
        _environment(tmp_path, meta)
