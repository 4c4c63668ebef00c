"""Why a sandbox's runtime ended (ADR 0036): the holder reads how often the host enforced the sandbox's
limits from its cgroup (v1 or v2) as the runtime ends, refusing cgroup paths that leave the hierarchy, and
the node turns that record into the reason it reports with the crash (hostile records give no reason or a
generic one, never an error)."""

from __future__ import annotations

import json
import pathlib

import pytest

from space.core.settings import SandboxLimits
from space.node.agent.service_core import crash_reason
from space.node.helper import holder_record


def _bundle(tmp_path: pathlib.Path, cgroup: object) -> list[str]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"linux": {"cgroupsPath": cgroup}}))
    return ["runsc", "--root=/x", "run", f"--bundle={bundle}", "sb-x-0"]


def test_v1_counters_are_read(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cg"
    (root / "memory/space/sb-x-0").mkdir(parents=True)
    (root / "pids/space/sb-x-0").mkdir(parents=True)
    (root / "memory/space/sb-x-0/memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    )
    (root / "pids/space/sb-x-0/pids.events").write_text("max 5\n")
    monkeypatch.setattr(holder_record, "CGROUP_ROOT", str(root))
    assert holder_record.limit_events(_bundle(tmp_path, "/space/sb-x-0")) == {
        "oom_kills": 2,
        "task_limit_hits": 5,
    }


def test_v2_counters_are_read(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cg"
    (root / "space/sb-x-0").mkdir(parents=True)
    (root / "space/sb-x-0/memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (root / "space/sb-x-0/pids.events").write_text("max 0\n")
    monkeypatch.setattr(holder_record, "CGROUP_ROOT", str(root))
    assert holder_record.limit_events(_bundle(tmp_path, "/space/sb-x-0")) == {
        "oom_kills": 1,
        "task_limit_hits": 0,
    }


@pytest.mark.parametrize("cgroup", ["/space/../../etc", "space/x", 7, None, ["/a"], "/../x"])
def test_hostile_or_missing_cgroups_give_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, cgroup: object
) -> None:
    monkeypatch.setattr(holder_record, "CGROUP_ROOT", str(tmp_path / "cg"))
    assert holder_record.limit_events(_bundle(tmp_path, cgroup)) == {}


def test_no_bundle_gives_nothing(tmp_path: pathlib.Path) -> None:
    assert holder_record.limit_events(["runsc", "run", "sb-x-0"]) == {}
    assert holder_record.limit_events(["runsc", f"--bundle={tmp_path / 'absent'}", "run"]) == {}


LIMITS = SandboxLimits(memory_mb=256)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"exit_code": 137, "oom_kills": 1, "task_limit_hits": 0},
         "killed by the host for exceeding the sandbox's memory limit (256 MB)"),
        ({"exit_code": 2, "oom_kills": 0, "task_limit_hits": 4},
         "the host's task limit of the sandbox was reached"),
        ({"exit_code": 137}, "killed (SIGKILL)"),
        ({"exit_code": 1, "oom_kills": 0}, "exited with code 1"),
        ({}, None),
        (None, None),
        ("garbage", None),
        ({"exit_code": "137", "oom_kills": True}, None),  # wrong types are no information
    ],
)  # fmt: skip
def test_crash_reasons(record: object, reason: str | None) -> None:
    assert crash_reason(record, LIMITS) == reason
