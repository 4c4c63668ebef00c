"""How the helper keeps the record of a checkpoint's hold (Runtimes.hold / release, ADR 0084), with the
sandbox's control server and runsc played by the test.

The sandbox counts its pauses and stops for good on a resume it was not paused for, so the record must
never ask for one resume too many: each release answers one hold, and a hold whose pause failed, a mark of
an older container and a mark of a runtime that no longer runs are dropped without a resume. The mark
outlives a failed resume, for the next try. Where runsc put its socket elsewhere, or itself paused the
runtime, runsc pauses and resumes it.
"""

from __future__ import annotations

import pathlib

import pytest

from space.core import errors
from space.node.helper import sentry
from space.node.helper.runtime import Runtimes
from tests.support.fake_runtimes import runtimes_on

SANDBOX = "sb-one"
CONTAINER = "sb-one-0"


class FakeSandbox:
    """The control server's side: the calls it got, and how the next ones go."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.refuse = False

    def __call__(self, root: pathlib.Path, container: str, method: sentry.Method, **_: object) -> None:
        assert container == CONTAINER
        if self.refuse:
            raise errors.RuntimeFailure(f"sandbox {container} refused {method.name.lower()}")
        self.calls.append(method.name)


@pytest.fixture()
def held_runtimes(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Runtimes, FakeSandbox]:
    runtimes = runtimes_on(tmp_path, monkeypatch, "running")
    runtimes.layout.run_dir(SANDBOX).mkdir(parents=True)
    runtimes.layout.runsc_root.mkdir(parents=True)
    sentry.control_socket(runtimes.layout.runsc_root, CONTAINER).touch()
    sandbox = FakeSandbox()
    monkeypatch.setattr(sentry, "call", sandbox)
    return runtimes, sandbox


def test_each_release_answers_one_hold(held_runtimes: tuple[Runtimes, FakeSandbox]) -> None:
    runtimes, sandbox = held_runtimes
    runtimes.hold(SANDBOX)
    runtimes.hold(SANDBOX)  # already held: not paused twice
    assert runtimes.held(SANDBOX) and runtimes.status(SANDBOX) == "paused"
    runtimes.release(SANDBOX)
    runtimes.release(SANDBOX)  # nothing held any more: never a second resume
    assert sandbox.calls == ["PAUSE", "RESUME"]
    assert not runtimes.held(SANDBOX) and runtimes.status(SANDBOX) == "running"
    assert runtimes.runsc.calls == []  # type: ignore[attr-defined]


def test_a_hold_whose_pause_failed_leaves_no_mark(held_runtimes: tuple[Runtimes, FakeSandbox]) -> None:
    runtimes, sandbox = held_runtimes
    sandbox.refuse = True
    with pytest.raises(errors.RuntimeFailure, match="refused pause"):
        runtimes.hold(SANDBOX)
    sandbox.refuse = False
    assert not runtimes.held(SANDBOX)
    runtimes.release(SANDBOX)
    assert sandbox.calls == []


def test_a_failed_resume_keeps_the_mark_for_the_next_try(held_runtimes: tuple[Runtimes, FakeSandbox]) -> None:
    runtimes, sandbox = held_runtimes
    runtimes.hold(SANDBOX)
    sandbox.refuse = True
    with pytest.raises(errors.RuntimeFailure, match="refused resume"):
        runtimes.release(SANDBOX)
    assert runtimes.held(SANDBOX)
    sandbox.refuse = False
    runtimes.release(SANDBOX)
    assert sandbox.calls == ["PAUSE", "RESUME"] and not runtimes.held(SANDBOX)


def test_a_mark_of_an_older_container_is_dropped_without_a_resume(
    held_runtimes: tuple[Runtimes, FakeSandbox],
) -> None:
    runtimes, sandbox = held_runtimes
    mark = runtimes.layout.run_dir(SANDBOX) / "held"
    mark.write_text("sb-one-older")  # the restore that followed started container sb-one-0
    assert not runtimes.held(SANDBOX) and runtimes.status(SANDBOX) == "running"
    runtimes.release(SANDBOX)
    assert sandbox.calls == [] and not mark.exists()


def test_a_mark_of_a_runtime_that_no_longer_runs_is_dropped_without_a_resume(
    held_runtimes: tuple[Runtimes, FakeSandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtimes, sandbox = held_runtimes
    runtimes.hold(SANDBOX)
    monkeypatch.setattr(runtimes, "runsc_status", lambda sandbox_id: "stopped")  # it died while held
    runtimes.release(SANDBOX)
    assert sandbox.calls == ["PAUSE"] and not (runtimes.layout.run_dir(SANDBOX) / "held").exists()


def test_without_the_socket_in_runsc_s_root_runsc_pauses_and_resumes(
    held_runtimes: tuple[Runtimes, FakeSandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtimes, sandbox = held_runtimes
    sentry.control_socket(runtimes.layout.runsc_root, CONTAINER).unlink()
    runtimes.hold(SANDBOX)
    assert not runtimes.held(SANDBOX)
    monkeypatch.setattr(runtimes, "runsc_status", lambda sandbox_id: "paused")  # what runsc now records
    runtimes.hold(SANDBOX)  # runsc's pause counts as held
    runtimes.release(SANDBOX)
    assert sandbox.calls == []
    assert runtimes.runsc.calls == [("pause", CONTAINER), ("resume", CONTAINER)]  # type: ignore[attr-defined]


def test_a_hold_of_a_runtime_that_does_not_run_is_refused(
    held_runtimes: tuple[Runtimes, FakeSandbox], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtimes, sandbox = held_runtimes
    monkeypatch.setattr(runtimes, "runsc_status", lambda sandbox_id: "stopped")
    with pytest.raises(errors.InvalidState, match="stopped"):
        runtimes.hold(SANDBOX)
    assert sandbox.calls == [] and not runtimes.held(SANDBOX)
