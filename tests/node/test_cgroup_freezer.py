"""The cgroup freezer's file protocol (ADR 0082), against cgroup trees made of plain files.

The real kernel is exercised by tests/runtime/test_runsc_freezer.py; here what the kernel would answer is
set by the test: v1's freezer.state (FROZEN, FREEZING, THAWED), v2's cgroup.freeze and cgroup.events.
A freeze that never converges is given up and thawed again; a runtime without a freezer is paused by
`runsc pause` instead.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from space.core import errors
from space.node.helper import freezer as freezer_module
from space.node.helper.freezer import CgroupFreezer
from tests.support.fake_runtimes import runtimes_on

CGROUP = "space-test/sb-one-0"


def v1_tree(root: pathlib.Path, state: str = "THAWED") -> pathlib.Path:
    leaf = root / "freezer" / CGROUP
    leaf.mkdir(parents=True)
    (leaf / "freezer.state").write_text(state)
    return leaf / "freezer.state"


def v2_tree(root: pathlib.Path, frozen: str = "0") -> pathlib.Path:
    leaf = root / CGROUP
    leaf.mkdir(parents=True)
    (leaf / "cgroup.freeze").write_text(frozen)
    (leaf / "cgroup.events").write_text(f"populated 1\nfrozen {frozen}\n")
    return leaf


def test_v1_freezes_thaws_and_counts_freezing_as_frozen(tmp_path: pathlib.Path) -> None:
    state = v1_tree(tmp_path)
    cg = CgroupFreezer(tmp_path)
    assert cg.available(CGROUP) and not cg.frozen(CGROUP)
    assert cg.freeze(CGROUP) is True
    assert state.read_text() == "FROZEN" and cg.frozen(CGROUP)
    cg.thaw(CGROUP)
    assert state.read_text() == "THAWED" and not cg.frozen(CGROUP)
    state.write_text("FREEZING")  # asked, not converged (e.g. a helper died mid-way): not running
    assert cg.frozen(CGROUP)


def test_a_freeze_that_never_converges_is_rewritten_then_given_up_and_thawed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = v1_tree(tmp_path)
    writes: list[str] = []
    real_read = freezer_module._read

    def kernel(path: pathlib.Path) -> str | None:  # a ptrace-stopped task that never freezes
        value = real_read(path)
        return "FREEZING" if value == "FROZEN" else value

    original_write = pathlib.Path.write_text

    def record(self: pathlib.Path, data: str, *args: Any, **kwargs: Any) -> int:
        writes.append(data)
        return original_write(self, data, *args, **kwargs)

    monkeypatch.setattr(freezer_module, "_read", kernel)
    monkeypatch.setattr(freezer_module, "FREEZE_WAIT_S", 0.05)
    monkeypatch.setattr(pathlib.Path, "write_text", record)
    assert CgroupFreezer(tmp_path).freeze(CGROUP) is False
    assert writes.count("FROZEN") > 2, "the request is written again while tasks are still freezing"
    assert writes[-1] == "THAWED" and state.read_text() == "THAWED"


def test_v2_freezes_by_cgroup_freeze_and_waits_for_the_event(tmp_path: pathlib.Path) -> None:
    leaf = v2_tree(tmp_path)
    cg = CgroupFreezer(tmp_path)
    (leaf / "cgroup.events").write_text("populated 1\nfrozen 1\n")  # what the kernel answers once frozen
    assert cg.freeze(CGROUP) is True
    assert (leaf / "cgroup.freeze").read_text() == "1" and cg.frozen(CGROUP)
    (leaf / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    cg.thaw(CGROUP)
    assert (leaf / "cgroup.freeze").read_text() == "0" and not cg.frozen(CGROUP)


def test_a_thaw_that_never_converges_is_a_runtime_failure(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leaf = v2_tree(tmp_path, frozen="1")  # the events file keeps saying frozen
    monkeypatch.setattr(freezer_module, "THAW_WAIT_S", 0.05)
    with pytest.raises(errors.RuntimeFailure, match="did not thaw"):
        CgroupFreezer(tmp_path).thaw(CGROUP)
    assert (leaf / "cgroup.freeze").read_text() == "0"


def test_without_a_freezer_nothing_is_frozen(tmp_path: pathlib.Path) -> None:
    cg = CgroupFreezer(tmp_path)
    assert not cg.available(CGROUP) and not cg.frozen(CGROUP)
    assert cg.freeze(CGROUP) is False
    cg.thaw(CGROUP)  # nothing to do
    assert not (tmp_path / "freezer").exists()


def test_a_pause_freezes_and_runsc_is_not_asked(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1_tree(tmp_path / "cgroup")
    runtimes = runtimes_on(tmp_path, monkeypatch, "running")
    runtimes.pause("sb-one")
    assert runtimes.status("sb-one") == "paused"
    runtimes.resume("sb-one")
    assert runtimes.status("sb-one") == "running"
    assert runtimes.runsc.calls == []  # type: ignore[attr-defined]


def test_without_a_freezer_a_pause_is_runsc_s(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtimes = runtimes_on(tmp_path, monkeypatch, "running")
    runtimes.pause("sb-one")
    assert runtimes.runsc.calls == [("pause", "sb-one-0")]  # type: ignore[attr-defined]


def test_a_resume_undoes_runsc_s_pause_too(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v1_tree(tmp_path / "cgroup", state="FROZEN")  # frozen by a user's pause, then paused by a checkpoint
    runtimes = runtimes_on(tmp_path, monkeypatch, "paused")
    runtimes.resume("sb-one")
    assert not runtimes.frozen("sb-one")
    assert runtimes.runsc.calls == [("resume", "sb-one-0")]  # type: ignore[attr-defined]


def test_a_pause_of_a_runtime_that_does_not_run_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v1_tree(tmp_path / "cgroup")
    runtimes = runtimes_on(tmp_path, monkeypatch, "stopped")
    with pytest.raises(errors.InvalidState, match="stopped"):
        runtimes.pause("sb-one")
    assert not runtimes.frozen("sb-one")
