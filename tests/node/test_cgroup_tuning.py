"""Cheap cgroup moves (space.node.helper.cgroup_tuning, ADR 0086): which mount node.prepare remounts, and
what it reports, from the kernel's feature list and mount table as the test writes them.

- A kernel without the mode, a host without a cgroup2 mount, or a mount that already has the option:
  nothing is remounted, and the answer says why.
- A hybrid host (cgroup v1 controllers plus the unified hierarchy) gets its cgroup2 mount remounted, with
  the path as /proc/mounts escapes it read back; a v1 mount is never touched.
- A remount that fails is reported, never raised: the node prepares as before.
- The setting reaches the helper: the local launcher and the systemd unit pass the flag that declines it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

from space.cli import service_units as su
from space.core import errors
from space.node.helper import cgroup_tuning
from space.node.helper.server import argument_parser

FEATURES = "nsdelegate\nfavordynmods\nmemory_localevents\n"
HYBRID = (
    "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
    "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
    "cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0\n"
    "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
)


def _tune(
    tmp_path: pathlib.Path, features: str | None, mounts: str, fails: bool = False
) -> tuple[str, list[str]]:
    remounted: list[str] = []

    def remount(path: str) -> None:
        if fails:
            raise errors.RuntimeFailure(f"remounting {path} failed: permission denied")
        remounted.append(path)

    features_file = tmp_path / "features"
    if features is not None:
        features_file.write_text(features)
    (tmp_path / "mounts").write_text(mounts)
    answer = cgroup_tuning.favor_dynamic_moves(features_file, tmp_path / "mounts", remount)
    return answer, remounted


def test_a_hybrid_host_gets_its_cgroup2_mount_remounted(tmp_path: pathlib.Path) -> None:
    assert _tune(tmp_path, FEATURES, HYBRID) == ("on", ["/sys/fs/cgroup/unified"])


def test_a_v2_host_gets_its_one_mount_remounted_with_the_path_unescaped(tmp_path: pathlib.Path) -> None:
    mounts = "cgroup2 /sys/fs/cgroup\\040x cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
    assert _tune(tmp_path, FEATURES, mounts) == ("on", ["/sys/fs/cgroup x"])


@pytest.mark.parametrize(
    ("features", "mounts", "answer"),
    [
        (FEATURES, HYBRID.replace("cgroup2 rw,relatime", "cgroup2 rw,relatime,favordynmods"), "on"),
        ("nsdelegate\nmemory_localevents\n", HYBRID, "unsupported"),
        (None, HYBRID, "unsupported"),
        (FEATURES, "".join(line + "\n" for line in HYBRID.splitlines()[:3]), "no cgroup2 mount"),
    ],
    ids=["already-on", "kernel-without-it", "no-feature-list", "v1-only-host"],
)
def test_nothing_is_remounted_where_nothing_can_or_need_be(
    tmp_path: pathlib.Path, features: str | None, mounts: str, answer: str
) -> None:
    assert _tune(tmp_path, features, mounts) == (answer, [])


def test_a_remount_that_fails_is_reported_not_raised(tmp_path: pathlib.Path) -> None:
    answer, remounted = _tune(tmp_path, FEATURES, HYBRID, fails=True)
    assert answer.startswith("failed: ") and "permission denied" in answer and remounted == []


def test_the_helper_takes_the_flag_either_way(tmp_path: pathlib.Path) -> None:
    base = ["--data-dir", str(tmp_path)]
    chosen = [
        argument_parser().parse_args(argv).favor_cgroup_moves
        for argv in (base, [*base, "--favor-cgroup-moves"], [*base, "--no-favor-cgroup-moves"])
    ]
    assert chosen == [True, True, False]


def test_the_helper_unit_declines_it_when_the_setting_does() -> None:
    plan = su.NodePlan(
        data_dir=pathlib.Path("/var/lib/space"), control_plane="https://cp.example.com",
        listen="127.0.0.1:7070", advertise_url="http://127.0.0.1:7070", templates="python",
        cgroup_parent="space", store_url=None, environment_file=pathlib.Path("/etc/space/node.env"),
    )  # fmt: skip
    assert "favor-cgroup-moves" not in su.helper_unit(plan, sys.executable).text
    declined = dataclasses.replace(plan, favor_cgroup_moves=False)
    assert "--no-favor-cgroup-moves" in su.helper_unit(declined, sys.executable).text
