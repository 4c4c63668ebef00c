"""An idle sandbox's host footprint and the size of a full checkpoint (issue 12, ADR 0045).

The numbers are the benchmark's (bench/memory_bench.py); these tests hold the behaviour they rest on: the
holder beside every sandbox imports nothing heavy and is started the lean way, an idle sandbox runs exactly
the host processes we account for, and a full checkpoint of a guest that wrote and freed 100 MB stores no
more than 1.2x the memory the guest uses, and restores its files and processes.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import subprocess

import pytest
from bench.memory_bench import guest_used_bytes, kind_of, sandbox_pids

from space.node.helper import holder, holder_record
from space.node.helper.runtime import Runtimes
from tests.support.sandboxes import eventually, new_sandbox, read_int, running_ids, start_counter

#: Modules a holder must not load while its sandbox runs: each costs every idle sandbox host memory.
HEAVY = {"subprocess", "selectors", "socket", "json", "enum", "typing", "contextlib", "re", "threading",
         "signal", "space"}  # fmt: skip
MiB = 1 << 20


def test_the_holder_loads_no_heavy_module() -> None:
    argv = Runtimes.holder_argv()
    assert argv[1:3] == ["-I", "-S"] and argv[-1] == "--spare"
    # The spare's own boot line, with a report of the loaded modules in place of the relay.
    boot = argv[4].replace("raise SystemExit(main())", "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([argv[0], "-I", "-S", "-c", boot], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "holder" in loaded
    assert loaded & HEAVY == set(), f"the holder loads {sorted(loaded & HEAVY)}"


def test_a_spare_that_is_never_assigned_exits_quietly() -> None:
    spare = subprocess.run(Runtimes.holder_argv(), input=b"", capture_output=True, timeout=60, check=False)
    assert (spare.returncode, spare.stderr) == (0, b"")


@pytest.mark.parametrize(
    "raw",
    [b"/s\0notanumber\0/log\0runsc", b"/s\x001000\0/log", b"only-one-field", b"\0\0\0", b"/s\0-1\0/l\0x"],
)
def test_malformed_assignments_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        holder.parse_assignment(raw)


def test_assignments_round_trip_and_refuse_nul_bytes() -> None:
    argv = ["ip", "netns", "exec", "ns 1", "runsc", "--bundle=/d/b\nx", "run", "sb-\u00e9-0"]
    raw = holder.encode_assignment("/run/sb/channel.sock", 1000, "/run/sb/runtime.log", argv)
    expected = ["/run/sb/channel.sock", "1000", "/run/sb/runtime.log", "--", *argv]
    assert holder.parse_assignment(raw) == expected
    assert holder.parse_assignment(b"") is None
    with pytest.raises(ValueError):
        holder.encode_assignment("/s", 0, "/l", ["runsc", "a\0b"])


@pytest.mark.parametrize(
    "value",
    [
        {"exit_code": -9, "ended_at": 1.5, "oom_kills": 0},
        {"argv": ['q"uote', "back\\slash", "new\nline\t\x01\x1f", "\u00e9\u4e2d\U0001f600", ""]},
        {"none": None, "yes": True, "list": [], "nested": {"k": 1}},
    ],
)
def test_the_holders_json_is_json(value: dict[str, object]) -> None:
    assert json.loads(holder_record.to_json(value)) == value


@pytest.mark.root
def test_an_idle_sandbox_runs_the_host_processes_we_account_for(node) -> None:
    async def scenario() -> None:
        async with new_sandbox(node.agent) as sb:
            assert (await sb.session.exec("true")).exit_code == 0
            pids = sandbox_pids(node.data_dir, sb.sandbox_id)
            kinds = collections.Counter(kind_of(pid) for pid in pids)
            assert kinds["holder (python)"] == 1
            assert kinds["runsc run|restore"] == 0, "runsc runs the sandbox detached"
            assert kinds["runsc gofer"] == 1
            assert kinds["runsc sandbox (Sentry)"] == 1
            assert not [kind for kind in kinds if kind.startswith("other")], kinds
            info = json.loads((node.data_dir / "run" / sb.sandbox_id / "holder.json").read_text())
            with open(f"/proc/{info['holder_pid']}/cmdline", "rb") as handle:
                cmdline = handle.read().split(b"\0")
            assert cmdline[1:3] == [b"-I", b"-S"], cmdline
            assert kind_of(info["runtime_pid"]) == "runsc sandbox (Sentry)"
            # The holder adopted the sandbox's processes (child subreaper): the Sentry and the gofer.
            with open(f"/proc/{info['holder_pid']}/task/{info['holder_pid']}/children") as handle:
                children = {kind_of(int(pid)) for pid in handle.read().split()}
            assert children == {"runsc sandbox (Sentry)", "runsc gofer"}, children

    node.run(scenario())


@pytest.mark.root
def test_a_checkpoint_after_writing_and_freeing_100mb_stores_what_the_guest_uses(node) -> None:
    """The guest writes 100 MB to a file and a process allocates and frees 100 MB: the image holds the
    guest's used memory (gVisor maps the rootfs' files from the host, so written data is not saved as page
    cache), at most 1.2x; and a rollback to it brings back the file and the running processes."""

    async def scenario() -> None:
        async with new_sandbox(node.agent) as sb:
            s = sb.session
            counter = await start_counter(s)
            wrote = await s.exec(
                "dd if=/dev/urandom of=/work/big.bin bs=1M count=100 2>/dev/null && sync "
                "&& sha256sum /work/big.bin"
            )
            assert wrote.exit_code == 0, wrote
            freed = await s.exec(
                "python3 -c \"b = bytearray(100 << 20); b[::4096] = b'x' * len(b[::4096]); del b\""
            )
            assert freed.exit_code == 0, freed
            used = await guest_used_bytes(sb)
            record = await node.agent.checkpoint(sb.sandbox_id)
            assert 0 < record.image_bytes <= 1.2 * used, (record.image_bytes, used)

            before = await read_int(s, "/work/counter")
            await s.exec("rm /work/big.bin")
            await node.agent.rollback(sb.sandbox_id, record.snapshot_id)
            s = node.agent.get(sb.sandbox_id).session
            assert (await s.exec("sha256sum /work/big.bin")).stdout == wrote.stdout
            assert counter in await running_ids(s)
            await eventually(lambda: _above(s, before), what="the restored counter counting")

    node.run(scenario())


@pytest.mark.root
def test_a_detached_sandbox_killed_under_its_holder_is_recorded_as_killed(node) -> None:
    """The Sentry is the runtime's process now: killing it ends the holder, which reaps it and the gofer and
    records the container's status the way runsc reports it (128 + SIGKILL)."""

    async def scenario() -> None:
        async with new_sandbox(node.agent) as sb:
            run_dir = node.data_dir / "run" / sb.sandbox_id
            info = json.loads((run_dir / "holder.json").read_text())
            pids = sandbox_pids(node.data_dir, sb.sandbox_id)
            os.kill(info["runtime_pid"], signal.SIGKILL)
            ended = await eventually(lambda: _exit_record(run_dir), what="exit.json written", timeout=30)
            assert ended["exit_code"] == 137, ended
            await eventually(lambda: _all_gone(pids), what="every process of the sandbox gone", timeout=30)

    node.run(scenario())


async def _exit_record(run_dir: pathlib.Path) -> dict[str, object] | None:
    try:
        return json.loads((run_dir / "exit.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


async def _all_gone(pids: set[int]) -> bool:
    return not [pid for pid in pids if pathlib.Path(f"/proc/{pid}").exists()]


async def _above(session, value: int) -> bool:  # type: ignore[no-untyped-def]
    return await read_int(session, "/work/counter") > value
