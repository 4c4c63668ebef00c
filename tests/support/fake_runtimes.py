"""A helper's `Runtimes` over a scratch directory, with runsc and the runtime's status played by the test."""

from __future__ import annotations

import pathlib

import pytest

from space.node.helper.freezer import CgroupFreezer
from space.node.helper.runtime import Runtimes
from space.node.layout import NodeLayout


class FakeRunsc:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def pause(self, container: str) -> None:
        self.calls.append(("pause", container))

    def resume(self, container: str) -> None:
        self.calls.append(("resume", container))


def runtimes_on(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, runsc_status: str) -> Runtimes:
    runtimes = Runtimes(NodeLayout(tmp_path / "node"), FakeRunsc(), owner_uid=0, cgroup_parent="space-test")  # type: ignore[arg-type]
    runtimes.freezer = CgroupFreezer(tmp_path / "cgroup")
    monkeypatch.setattr(runtimes, "container", lambda sandbox_id: "sb-one-0")
    monkeypatch.setattr(runtimes, "runsc_status", lambda sandbox_id: runsc_status)
    monkeypatch.setattr(runtimes, "settled_status", runtimes.status)
    return runtimes
