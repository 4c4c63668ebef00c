"""`make demo`: one node on this machine, one sandbox through its whole lifecycle, each step timed.

As root it starts the privileged helper, then runs the agent's part as the unprivileged `space` user (the
production privilege split); `--agent` is that second half.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import pwd
import subprocess
import sys
import time
from collections.abc import Awaitable
from typing import TypeVar

from space.node.local import LocalNode, connect_agent

T = TypeVar("T")
DEFAULT_DATA_DIR = pathlib.Path("/var/lib/space-demo")
AGENT_USER = "space"


async def timed(label: str, work: Awaitable[T]) -> T:
    started = time.perf_counter()
    result = await work
    print(f"  {label:<48} {(time.perf_counter() - started) * 1000:8.1f} ms", flush=True)
    return result


async def agent_steps(data_dir: pathlib.Path) -> None:
    agent = connect_agent(data_dir)
    print(f"agent running as uid {os.getuid()} ({pwd.getpwuid(os.getuid()).pw_name})")
    sandbox = await timed("create sandbox (python template)", agent.create("python"))
    sid = sandbox.sandbox_id
    try:
        result = await timed(
            "exec python3 -c 'print(sum(range(10**6)))'",
            sandbox.session.exec(["python3", "-c", "print(sum(range(10**6)))"]),
        )
        print(f"    -> exit {result.exit_code}, stdout {result.stdout.decode().strip()!r}")
        await timed("write /work/hello.txt", sandbox.session.write_file("/work/hello.txt", b"hello, space\n"))
        data = await timed("read /work/hello.txt", sandbox.session.read_file("/work/hello.txt"))
        print(f"    -> {data!r}")
        counter = "i=0; while true; do i=$((i+1)); echo $i > /work/counter; sleep 0.1; done"
        await timed("start a background counter", sandbox.session.start_background(counter, tag="counter"))
        await timed("pause", agent.pause(sid))
        await timed("resume", agent.resume(sid))
        snap = await timed("checkpoint (full, keeps running)", agent.checkpoint(sid))
        print(f"    -> {snap.snapshot_id}, image {snap.image_bytes / 1e6:.1f} MB")
        await sandbox.session.write_file("/work/after.txt", b"written after the checkpoint\n")
        await timed("restore (roll back to the checkpoint)", agent.rollback(sid, snap.snapshot_id))
        names = sorted(entry["name"] for entry in await sandbox.session.list_dir("/work"))
        print(f"    -> /work now holds {names} (after.txt is gone)")
        await asyncio.sleep(0.3)
        count = (await sandbox.session.read_file("/work/counter")).decode().strip()
        print(f"    -> the counter restored with the checkpoint keeps counting: {count}")
        children = await timed(
            "fork (child continues from the checkpoint)", agent.fork(sid, snapshot_id=snap.snapshot_id)
        )
        child_data = await children[0].session.read_file("/work/hello.txt")
        print(f"    -> child {children[0].sandbox_id} reads {child_data!r}")
        for child in children:
            await timed(f"delete child {child.sandbox_id[:10]}…", agent.delete(child.sandbox_id))
    finally:
        await timed("delete sandbox", agent.delete(sid))
        await agent.close()


def run_agent_as(user: str, data_dir: pathlib.Path) -> int:
    entry = pwd.getpwnam(user)
    src = pathlib.Path(__file__).resolve().parents[2]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/",
        "PYTHONPATH": str(src),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    argv = [
        "setpriv",
        f"--reuid={entry.pw_uid}",
        f"--regid={entry.pw_gid}",
        "--clear-groups",
        sys.executable,
        "-m",
        "space.node.demo",
        "--agent",
        "--data-dir",
        str(data_dir),
    ]
    return subprocess.call(argv, env=env)


async def main_async(data_dir: pathlib.Path, keep: bool) -> int:
    try:
        agent_uid: str | int = pwd.getpwnam(AGENT_USER).pw_uid
    except KeyError:
        print(f"note: no '{AGENT_USER}' user: the agent runs as root (run `make setup` to create it)")
        agent_uid = 0
    node = LocalNode(data_dir, agent_user=agent_uid)
    print(f"node data directory: {data_dir}")
    started = time.perf_counter()
    await node.start(progress=lambda line: print(f"  | {line}", flush=True))
    print(
        f"  {'node ready (helper, btrfs, python template)':<48} "
        f"{(time.perf_counter() - started) * 1000:8.1f} ms"
    )
    try:
        if agent_uid:
            code = run_agent_as(AGENT_USER, data_dir)
        else:
            await agent_steps(data_dir)
            code = 0
    finally:
        print("cleaning up (sandboxes, mounts, loop device)" if not keep else "keeping the node's data")
        await node.stop(purge=not keep)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SPACE node-level demo")
    parser.add_argument("--data-dir", type=pathlib.Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--agent", action="store_true", help="run only the agent's part (unprivileged)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory afterwards")
    args = parser.parse_args(argv)
    if args.agent:
        asyncio.run(agent_steps(args.data_dir))
        return 0
    if os.geteuid() != 0:
        print("the demo starts the node's root helper: run it as root", file=sys.stderr)
        return 2
    return asyncio.run(main_async(args.data_dir, args.keep))


if __name__ == "__main__":
    raise SystemExit(main())
