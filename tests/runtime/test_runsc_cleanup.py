"""Deleting a sandbox leaves nothing of it on the host: processes, cgroups, subvolumes, run files."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from space.node.agent.agent import NodeAgent
from tests.support.host import processes_mentioning
from tests.support.sandboxes import delete_quietly, start_counter

pytestmark = pytest.mark.root


def cgroup_dirs_of(sandbox_id: str) -> list[str]:
    """Every cgroup dir of the sandbox, whatever the helper calls its runtime containers."""
    base = pathlib.Path("/sys/fs/cgroup")
    return sorted(str(p) for p in base.glob(f"*/space/{sandbox_id}*"))


def subvolumes_mentioning(fs_root: pathlib.Path, text: str) -> list[str]:
    out = subprocess.run(
        ["btrfs", "subvolume", "list", "-a", str(fs_root)], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if text in line]


def files_mentioning(data_dir: pathlib.Path, sandbox_id: str) -> list[str]:
    """The sandbox's bundle, snapshots, checkpoints and run files, and runsc's state files for it."""
    places = [
        data_dir / "fs" / "sandboxes" / sandbox_id,
        data_dir / "fs" / "snapshots" / sandbox_id,
        data_dir / "fs" / "checkpoints" / sandbox_id,
        data_dir / "run" / sandbox_id,
    ]
    found = [str(p) for p in places if p.exists()]
    found += [str(p) for p in (data_dir / "runsc").glob(f"*{sandbox_id}*")]
    return sorted(found)


def test_delete_leaves_nothing_behind(node) -> None:
    agent: NodeAgent = node.agent
    fs_root = node.data_dir / "fs"

    async def scenario() -> list[str]:
        running = await agent.create("python")
        paused = await agent.create("python")
        ids = [running.sandbox_id, paused.sandbox_id]
        try:
            await start_counter(running.session)
            await running.session.start_background("sleep 600")
            await agent.disk_snapshot(running.sandbox_id)
            await agent.checkpoint(running.sandbox_id)
            children = await agent.fork(running.sandbox_id)
            ids.append(children[0].sandbox_id)
            await paused.session.start_background("sleep 600")
            await agent.pause(paused.sandbox_id)

            for sid in ids:  # while alive, every probe below does see the sandbox
                assert processes_mentioning(sid), f"no process of {sid}?"
                assert cgroup_dirs_of(sid), f"no cgroup of {sid}?"
                assert subvolumes_mentioning(fs_root, sid), f"no subvolume of {sid}?"
        finally:
            await delete_quietly(agent, *ids)
        return ids

    ids = node.run(scenario())
    for sid in ids:
        assert processes_mentioning(sid) == [], f"processes of {sid} survived its deletion"
        assert cgroup_dirs_of(sid) == [], f"cgroups of {sid} survived its deletion"
        assert subvolumes_mentioning(fs_root, sid) == [], f"subvolumes of {sid} survived its deletion"
        assert files_mentioning(node.data_dir, sid) == [], f"files of {sid} survived its deletion"

    async def observed() -> dict:
        return {o.sandbox_id: o for o in await agent.driver.list()}

    listed = node.run(observed())
    for sid in ids:
        assert sid not in listed
        assert sid not in agent.sandboxes
