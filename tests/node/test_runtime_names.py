"""Runtime names of pooled sandboxes (space.node.agent.runtime_names, ADR 0047): translation both ways in
one place, claims that are active before they are durable, one runtime per sandbox id and never a second
bind, persistence that survives a restart, and a hostile or damaged file that never becomes an alias;
pool sizes as operators write them."""

from __future__ import annotations

import json
import pathlib

import pytest

from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.agent.pools import parse_pool_sizes
from space.node.agent.runtime_names import RuntimeNames


def _names(tmp_path: pathlib.Path) -> RuntimeNames:
    return RuntimeNames(tmp_path / "identity" / "runtime-names.json")


def test_a_bind_translates_only_once_claimed_and_survives_a_restart(tmp_path: pathlib.Path) -> None:
    names = _names(tmp_path)
    runtime, sandbox, other = new_sandbox_id(), new_sandbox_id(), new_sandbox_id()
    names.add_member(runtime, "python")
    assert names.to_runtime(sandbox) == sandbox  # unbound ids are themselves
    assert names.args_to_runtime({"sandbox_id": sandbox}) == {"sandbox_id": sandbox}

    names.claim(sandbox, runtime)
    assert names.to_runtime(sandbox) == runtime  # the bind's own helper calls reach the runtime
    assert names.args_to_runtime({"sandbox_id": sandbox, "source_sandbox_id": sandbox, "x": sandbox}) == {
        "sandbox_id": runtime, "source_sandbox_id": runtime, "x": sandbox,
    }  # fmt: skip
    assert names.result_to_sandbox(
        {"sandboxes": [{"sandbox_id": runtime, "spec": {"sandbox_id": other}}]}
    ) == {"sandboxes": [{"sandbox_id": sandbox, "spec": {"sandbox_id": other}}]}
    # Not durable yet: a restart now finds a member (destroyed at start), no alias.
    reloaded = _names(tmp_path)
    assert reloaded.to_runtime(sandbox) == sandbox and reloaded.members() == {runtime: "python"}

    names.commit(sandbox)
    assert names.members() == {}
    reloaded = _names(tmp_path)
    assert reloaded.to_runtime(sandbox) == runtime and reloaded.to_sandbox(runtime) == sandbox
    assert (tmp_path / "identity" / "runtime-names.json").stat().st_mode & 0o777 == 0o600

    names.forget(sandbox)
    assert names.to_runtime(sandbox) == sandbox
    assert _names(tmp_path).to_runtime(sandbox) == sandbox


def test_a_member_serves_one_sandbox_once(tmp_path: pathlib.Path) -> None:
    names = _names(tmp_path)
    runtime, first, second = new_sandbox_id(), new_sandbox_id(), new_sandbox_id()
    names.add_member(runtime, "python")
    names.claim(first, runtime)
    with pytest.raises(errors.Conflict):
        names.claim(second, runtime)  # claimed already
    names.commit(first)
    with pytest.raises(errors.Conflict):
        names.claim(second, runtime)  # bound: never offered again
    with pytest.raises(errors.AlreadyExists):
        names.add_member(runtime, "python")  # a bound runtime never becomes a member again
    with pytest.raises(errors.Conflict):
        names.claim(second, new_sandbox_id())  # not a member at all
    other = new_sandbox_id()
    names.add_member(other, "python")
    with pytest.raises(errors.AlreadyExists):
        names.claim(first, other)  # an id that already has a runtime
    assert names.release(second) is None


def test_a_released_claim_leaves_the_member_to_destroy(tmp_path: pathlib.Path) -> None:
    names = _names(tmp_path)
    runtime, sandbox = new_sandbox_id(), new_sandbox_id()
    names.add_member(runtime, "python")
    names.claim(sandbox, runtime)
    assert names.release(sandbox) == runtime
    assert names.to_runtime(sandbox) == sandbox
    assert names.is_member(runtime)
    names.drop_member(runtime)
    assert _names(tmp_path).members() == {}


def test_a_failed_commit_changes_nothing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = _names(tmp_path)
    runtime, sandbox = new_sandbox_id(), new_sandbox_id()
    names.add_member(runtime, "python")
    names.claim(sandbox, runtime)

    def disk_full(*_args: object, **_kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("space.node.filemodes.os.fsync", disk_full)
    with pytest.raises(OSError):
        names.commit(sandbox)
    monkeypatch.undo()
    assert names.release(sandbox) == runtime and names.is_member(runtime)
    assert names.to_sandbox(runtime) == runtime


A, B, C = new_sandbox_id(), new_sandbox_id(), new_sandbox_id()


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"version": 1, "aliases": {"sb-../../etc": C}, "members": {}}),
        json.dumps({"version": 1, "aliases": {A: C}, "members": {B: "../etc"}}),
        # one runtime behind two sandbox ids: a request for one would act on the other's sandbox
        json.dumps({"version": 1, "aliases": {A: C, B: C}, "members": {}}),
        # a bound runtime that is also a member: it could be bound a second time
        json.dumps({"version": 1, "aliases": {A: C}, "members": {C: "python"}}),
        json.dumps({"aliases": []}),
    ],
)
def test_a_damaged_or_hostile_file_gives_no_alias(tmp_path: pathlib.Path, content: str) -> None:
    path = tmp_path / "identity" / "runtime-names.json"
    path.parent.mkdir()
    path.write_text(content)
    names = RuntimeNames(path)
    assert names.members() == {}
    assert (names.to_runtime(A), names.to_runtime(B)) == (A, B)


def test_a_sound_file_is_read(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "identity" / "runtime-names.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"version": 1, "aliases": {A: C}, "members": {B: "python"}}))
    names = RuntimeNames(path)
    assert (names.to_runtime(A), names.members()) == (C, {B: "python"})


def test_pool_sizes() -> None:
    assert parse_pool_sizes("") == {}
    assert parse_pool_sizes("python=4, web-app=0") == {"python": 4, "web-app": 0}
    for bad in ("python", "python=-1", "python=x", "Python=1", "python=257", "../x=1", "python=1e3"):
        with pytest.raises(errors.InvalidArgument):
            parse_pool_sizes(bad)
