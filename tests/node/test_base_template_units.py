"""The built-in template table and how a template's defaults become the daemon's boot environment
(space.node.volumes.templates, ADR 0057), without a node: metadata is hostile input until checked."""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.core.errors import RuntimeFailure
from space.node.drivers.fake import FakeDriver
from space.node.volumes import templates
from tests.support.node_rpc import Rpc, fake_node_rpc


def _environment(tmp_path: Path, meta: dict[str, Any] | None) -> dict[str, str]:
    if meta is not None:
        (tmp_path / "t.json").write_text(json.dumps(meta))
    return templates.guest_environment(tmp_path, "t")


def test_the_built_ins_and_their_defaults() -> None:
    assert templates.TEMPLATE_NAMES == ("python", "base", "browser")
    assert templates.builtin_defaults("python") == {}
    assert templates.builtin_defaults("base") == {
        "default_user": "user",
        "workdir": "/home/user",
        "env": {"HOME": "/home/user", "USER": "user", "LOGNAME": "user"},
    }
    files = {path: mode for path, _content, mode in templates.BUILTIN_TEMPLATES["base"].files}
    assert files == {"/etc/sudoers.d/user": 0o440, "/usr/local/bin/sudo": 0o755}
    assert "sudo_client.py" in templates.SUDO_WRAPPER and templates.SUDO_WRAPPER.startswith("#!/bin/sh\n")
    # browser (ADR 0064): base's defaults and files, Chromium from a package layer, its start script
    browser = templates.BUILTIN_TEMPLATES["browser"]
    assert templates.builtin_defaults("browser") == templates.builtin_defaults("base")
    assert {path: mode for path, _content, mode in browser.files} == {**files, templates.BROWSER_START: 0o755}
    assert "chromium" in browser.packages and browser.packages_version
    assert "--remote-debugging-address=127.0.0.1" in templates.BROWSER_START_SCRIPT


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


# --- the `user` of file writes and mkdir through the node RPC (fake driver: spaced as a host process) -------
@pytest.fixture(scope="module")
def rpc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rpc]:
    with fake_node_rpc(tmp_path_factory.mktemp("node")) as served:
        yield served


HOSTILE_USERS = ("bad user", "../etc", "-rf", "x" * 65, "a\0b", "", "1" * 10, "%2e%2e", "root\n")


@pytest.fixture(scope="module")
def sandbox_id(rpc: Rpc) -> Iterator[str]:
    made = rpc.new()
    yield made
    rpc.run(rpc.agent.delete(made))


def test_a_hostile_user_is_refused_before_the_sandbox_sees_it(rpc: Rpc, sandbox_id: str) -> None:
    url = f"/node/v1/sandboxes/{sandbox_id}/files"
    for user in HOSTILE_USERS:
        answer = rpc.http.put(url, params={"path": "f.txt", "user": user}, content=b"x")
        assert answer.status_code in (400, 422), (user, answer.text)
        made = rpc.http.post(f"{url}/mkdir", json={"path": "d", "user": user})
        assert made.status_code in (400, 422), (user, made.text)
    listed = rpc.run(rpc.client.list_files(sandbox_id, "."))
    assert {entry["name"] for entry in listed} & {"f.txt", "d"} == set()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_named_user_owns_what_the_write_creates(rpc: Rpc, sandbox_id: str) -> None:
    nobody = pwd.getpwnam("nobody")
    rpc.run(rpc.client.write_file(sandbox_id, "by/nobody.txt", b"x", user="nobody"))
    rpc.run(rpc.client.mkdir(sandbox_id, "made/by", user=str(nobody.pw_uid)))
    rpc.run(rpc.client.write_file(sandbox_id, "root.txt", b"x"))
    driver = rpc.agent.driver
    assert isinstance(driver, FakeDriver)
    work = driver.base_dir / "sandboxes" / sandbox_id / "work"
    for path in ("by", "by/nobody.txt", "made", "made/by"):
        assert os.lstat(work / path).st_uid == nobody.pw_uid, path
    assert os.lstat(work / "root.txt").st_uid == 0
