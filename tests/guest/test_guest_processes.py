"""spaced's processes: exec, streams, stdin, timeouts, signals, users, PTYs, background/attach, floods,
detach, and reaping as an init."""

from __future__ import annotations

import os
import pwd
import queue
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from space.protocol.frames import Channel, FrameType
from tests.support.guest_harness import Guest, Reply


@pytest.fixture(scope="module", params=["per-child", "reap-all"])
def guest(request: pytest.FixtureRequest) -> Iterator[Guest]:
    """Every test runs against both ways of collecting exit statuses (reap-all is what PID 1 does)."""
    g = Guest(
        env={"SPACED_SECRET_SETTING": "hidden", "VISIBLE_SETTING": "shown"},
        reap_all=request.param == "reap-all",
    )
    yield g
    g.close()


def run(guest: Guest, **params: Any) -> Reply:
    return guest.call("process.start", params, timeout=20)


def start_background(guest: Guest, **params: Any) -> str:
    result = guest.call("process.start", {**params, "background": True}).result
    assert result["pid"] > 0
    return str(result["process_id"])


def attach(guest: Guest, process_id: str, **params: Any) -> Reply:
    return guest.call("process.attach", {"process_id": process_id, **params})


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a live pid, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def children_of(ppid: int) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = proc_state(int(entry))
            if state is not None and state[1] == ppid:
                found.append((int(entry), state[0]))
    return found


def listed(guest: Guest) -> dict[str, dict[str, Any]]:
    return {p["process_id"]: p for p in guest.call("process.list").result["processes"]}


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


# --- exec -------------------------------------------------------------------------------------------------


def test_exec_argv(guest: Guest) -> None:
    reply = run(guest, argv=["echo", "hello", "world"])
    assert reply.result["exit_code"] == 0 and reply.result["signal"] is None
    assert reply.stdout == b"hello world\n" and reply.stderr == b""
    started = reply.events[0]
    assert started["type"] == "started" and started["process_id"] == reply.result["process_id"]


def test_exec_shell_exit_code_and_stream_separation(guest: Guest) -> None:
    reply = run(guest, cmd="echo out; echo err >&2; exit 7")
    assert reply.result["exit_code"] == 7
    assert reply.stdout == b"out\n" and reply.stderr == b"err\n"


def test_env_is_merged_over_defaults(guest: Guest) -> None:
    reply = run(guest, cmd="env", env={"MY_VAR": "x=y", "LANG": "C"})
    env = dict(line.split("=", 1) for line in reply.stdout.decode().splitlines())
    assert env["MY_VAR"] == "x=y" and env["LANG"] == "C"
    assert "/usr/bin" in env["PATH"] and env["HOME"]
    assert env["VISIBLE_SETTING"] == "shown"
    assert "SPACED_SECRET_SETTING" not in env and "PYTHONPATH" not in env
    reply = run(guest, argv=["sh", "-c", "echo $LANG"])
    assert reply.stdout == b"C.UTF-8\n"


def test_cwd(guest: Guest, tmp_path: Any) -> None:
    assert run(guest, argv=["pwd"], cwd=str(tmp_path)).stdout.decode().strip() == str(tmp_path)
    default = "/work" if os.path.isdir("/work") else "/"
    assert run(guest, argv=["pwd"]).stdout.decode().strip() == default


def test_start_errors(guest: Guest, tmp_path: Any) -> None:
    assert run(guest, argv=["/no/such/binary"]).error["code"] == "not_found"
    assert run(guest, argv=["true"], cwd=str(tmp_path / "missing")).error["code"] == "not_found"
    assert run(guest, argv=["true"], cmd="true").error["code"] == "invalid_argument"
    assert run(guest, argv=[]).error["code"] == "invalid_argument"
    assert run(guest, argv=["true"], timeout=-1).error["code"] == "invalid_argument"
    assert run(guest, argv=["true"], user="no-such-user-xyz").error["code"] == "invalid_argument"
    assert guest.call("process.attach", {"process_id": "nope"}).error["code"] == "no_such_process"


def test_exec_round_trip_is_fast(guest: Guest) -> None:
    timings = []
    for _ in range(20):
        started = time.monotonic()
        assert run(guest, argv=["true"]).result["exit_code"] == 0
        timings.append(time.monotonic() - started)
    assert statistics.median(timings) < 0.05, timings


# --- stdin ------------------------------------------------------------------------------------------------


def test_stdin_streaming_and_close(guest: Guest) -> None:
    stream = guest.open("process.start", {"argv": ["cat"], "stdin": True})
    guest.send_body(stream, b"first ", eof=False)
    time.sleep(0.05)
    guest.send_body(stream, b"second" * 50000, eof=False)
    guest.send_body(stream, b"", eof=True)
    reply = guest.collect(stream)
    assert reply.result["exit_code"] == 0
    assert reply.stdout == b"first " + b"second" * 50000


def test_without_stdin_reads_devnull(guest: Guest) -> None:
    assert run(guest, argv=["cat"]).stdout == b""


def test_process_input_to_background(guest: Guest) -> None:
    process_id = start_background(guest, argv=["cat"], stdin=True)
    stream = guest.open("process.input", {"process_id": process_id, "eof": True})
    guest.send_body(stream, b"abc\n")
    assert guest.collect(stream).result == {"written": 4}
    reply = attach(guest, process_id)
    assert reply.stdout == b"abc\n" and reply.result["exit_code"] == 0


# --- timeouts and signals ---------------------------------------------------------------------------------


def test_timeout_kills_the_whole_group(guest: Guest) -> None:
    started = time.monotonic()
    reply = run(guest, cmd="sleep 30 & echo $!; sleep 30", timeout=0.5)
    assert time.monotonic() - started < 5
    assert reply.result["timed_out"] is True and reply.result["signal"] == 9
    grandchild = int(reply.stdout)
    assert wait_until(lambda: proc_state(grandchild) is None or proc_state(grandchild)[0] == "Z")  # type: ignore[index]


def test_signals_by_name_and_number(guest: Guest) -> None:
    process_id = start_background(guest, argv=["sleep", "30"])
    assert guest.call("process.signal", {"process_id": process_id, "signal": "SIGTERM"}).ok
    assert attach(guest, process_id).result["signal"] == 15
    process_id = start_background(guest, argv=["sleep", "30"])
    assert guest.call("process.signal", {"process_id": process_id, "signal": "int"}).ok
    assert attach(guest, process_id).result["signal"] == 2
    process_id = start_background(guest, argv=["sleep", "30"])
    assert guest.call("process.signal", {"process_id": process_id, "signal": 9}).ok
    assert attach(guest, process_id).result["signal"] == 9
    bad = guest.call("process.signal", {"process_id": process_id, "signal": "SIGNOPE"})
    assert bad.error["code"] == "invalid_argument"
    gone = guest.call("process.signal", {"process_id": process_id, "signal": "TERM"})
    assert gone.error["code"] == "no_such_process"


def test_trapped_signal_and_exit_code(guest: Guest) -> None:
    stream = guest.open(
        "process.start", {"cmd": "trap 'echo got; exit 42' TERM; echo ready; while :; do sleep 0.05; done"}
    )
    process_id = guest.next_frame(stream).json()["process_id"]
    frame = guest.next_frame(stream)
    assert frame.type == FrameType.DATA and frame.channel_data() == (Channel.STDOUT, b"ready\n")
    assert guest.call("process.signal", {"process_id": process_id, "signal": "TERM", "group": False}).ok
    reply = guest.collect(stream)
    assert reply.result["exit_code"] == 42 and reply.stdout == b"got\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_user_switching(guest: Guest) -> None:
    nobody = pwd.getpwnam("nobody")
    reply = run(guest, cmd="id -u; id -g; echo $HOME $USER", user="nobody")
    assert reply.stdout.decode().split() == [str(nobody.pw_uid), str(nobody.pw_gid), nobody.pw_dir, "nobody"]
    reply = run(guest, argv=["id", "-u"], user=nobody.pw_uid)
    assert reply.stdout == f"{nobody.pw_uid}\n".encode()
    assert run(guest, argv=["touch", "/root/spaced-nobody-test"], user="nobody").result["exit_code"] != 0


# --- PTY --------------------------------------------------------------------------------------------------


def test_pty_size_and_terminal(guest: Guest) -> None:
    reply = run(
        guest, cmd="stty size; test -t 0 && test -t 1 && echo tty; echo $TERM", pty={"rows": 33, "cols": 101}
    )
    assert reply.result["exit_code"] == 0
    assert reply.stdout.split() == [b"33", b"101", b"tty", b"xterm-256color"]
    assert reply.stderr == b""


def test_pty_resize_and_input(guest: Guest) -> None:
    stream = guest.open(
        "process.start",
        {"cmd": "read line; stty size; echo got:$line", "pty": {"rows": 24, "cols": 80}, "stdin": True},
    )
    process_id = guest.next_frame(stream).json()["process_id"]
    assert guest.call("process.resize", {"process_id": process_id, "rows": 40, "cols": 120}).ok
    guest.send_body(stream, b"hello\n", eof=False)
    reply = guest.collect(stream)
    assert reply.result["exit_code"] == 0
    assert b"40 120" in reply.stdout and b"got:hello" in reply.stdout
    not_pty = start_background(guest, argv=["sleep", "5"])
    assert guest.call("process.resize", {"process_id": not_pty, "rows": 1, "cols": 1}).error["code"] == (
        "not_a_terminal"
    )
    guest.call("process.signal", {"process_id": not_pty, "signal": "KILL"})


def test_pty_controlling_terminal_gets_ctrl_c(guest: Guest) -> None:
    stream = guest.open("process.start", {"cmd": "echo go; sleep 30", "pty": True, "stdin": True})
    guest.next_frame(stream)
    assert guest.next_frame(stream).channel_data()[1].startswith(b"go")
    # ^C from the terminal: SIGINT to the foreground group. The shell may still be starting `sleep` when the
    # first one arrives (seen on a loaded machine), so a user would press it again: so does the test.
    guest.send_body(stream, b"\x03", eof=False)
    try:
        reply = guest.collect(stream, timeout=2)
    except queue.Empty:
        guest.send_body(stream, b"\x03", eof=False)
        reply = guest.collect(stream, timeout=5)
    assert reply.result["signal"] == 2 or reply.result["exit_code"] == 130


# --- background, attach, list -----------------------------------------------------------------------------


def test_background_list_and_attach(guest: Guest) -> None:
    process_id = start_background(guest, cmd="echo one; sleep 0.3; echo two >&2", tag="bg-test")
    entry = listed(guest)[process_id]
    assert entry["running"] is True and entry["tag"] == "bg-test" and entry["argv"][:2] == ["/bin/sh", "-c"]
    assert guest.call("sys.info").result["running_processes"] >= 1

    live = attach(guest, process_id)
    assert live.events[0] == {"type": "attached", "offset": 0, "truncated": False}
    assert live.stdout == b"one\n" and live.stderr == b"two\n"
    assert live.result["exit_code"] == 0 and live.result["process_id"] == process_id

    middle = attach(guest, process_id, offset=2)
    assert middle.events[0]["offset"] == 2 and middle.stdout == b"e\n" and middle.stderr == b"two\n"
    assert middle.result["exit_code"] == 0

    snapshot = attach(guest, process_id, offset=0, follow=False)
    assert snapshot.result == {"process_id": process_id, "offset": 8, "running": False}
    assert snapshot.stdout == b"one\n"

    entry = listed(guest)[process_id]
    assert entry["running"] is False and entry["exit_code"] == 0 and entry["output_bytes"] == 8
    assert entry["ended_at"] >= entry["started_at"]


def test_truncated_buffer_is_reported(guest: Guest) -> None:
    total = 10_000_000
    process_id = start_background(guest, argv=["head", "-c", str(total), "/dev/zero"])
    assert wait_until(lambda: not listed(guest)[process_id]["running"])
    reply = attach(guest, process_id)
    first = reply.events[0]
    assert first["truncated"] is True and first["offset"] > 0
    delivered = reply.data_bytes[Channel.STDOUT]
    assert first["offset"] + delivered == total and delivered <= 8 << 20
    assert reply.result["offset"] == total


def test_flood_does_not_starve_pings(guest: Guest) -> None:
    stream = guest.open("process.start", {"argv": ["yes", "flood"], "timeout": 2.0})
    box: dict[str, Reply] = {}
    collector = threading.Thread(target=lambda: box.setdefault("r", guest.collect(stream, keep_data=False)))
    collector.start()
    time.sleep(0.2)
    latencies = []
    while collector.is_alive() and len(latencies) < 30:
        latencies.append(guest.ping_seconds())
        time.sleep(0.03)
    collector.join(timeout=15)
    reply = box["r"]
    assert reply.result["timed_out"] is True
    assert reply.data_bytes[Channel.STDOUT] > 10 << 20
    assert max(latencies) < 0.5, latencies


def test_never_exiting_process_detach_and_reattach(guest: Guest) -> None:
    stream = guest.open("process.start", {"cmd": "echo started; exec sleep 60"})
    process_id = guest.next_frame(stream).json()["process_id"]
    assert guest.next_frame(stream).channel_data() == (Channel.STDOUT, b"started\n")
    assert guest.ping_seconds() < 1
    guest.cancel(stream)
    detached = guest.collect(stream)
    assert detached.error["code"] == "cancelled" and detached.error["process_id"] == process_id
    assert listed(guest)[process_id]["running"] is True

    stream = guest.open("process.attach", {"process_id": process_id})
    assert guest.next_frame(stream).json()["type"] == "attached"
    assert guest.next_frame(stream).channel_data() == (Channel.STDOUT, b"started\n")
    assert guest.call("process.signal", {"process_id": process_id, "signal": "KILL"}).ok
    assert guest.collect(stream).result["signal"] == 9


def test_exited_process_is_attachable_later(guest: Guest) -> None:
    process_id = run(guest, cmd="printf late").result["process_id"]
    time.sleep(0.1)
    reply = attach(guest, process_id)
    assert reply.stdout == b"late" and reply.result["exit_code"] == 0


def test_descendant_holding_stdout_does_not_block_the_result(guest: Guest) -> None:
    started = time.monotonic()
    reply = run(guest, cmd="sleep 5 & echo parent done")
    assert reply.result["exit_code"] == 0 and reply.stdout == b"parent done\n"
    assert time.monotonic() - started < 3


# --- reaping as an init -----------------------------------------------------------------------------------


def test_orphans_are_reaped_in_reap_all_mode() -> None:
    g = Guest(reap_all=True)
    try:
        reply = run(g, cmd="sleep 0.5 >/dev/null 2>&1 & echo $!; exit 0")
        assert reply.result["exit_code"] == 0
        orphan = int(reply.stdout)
        state = proc_state(orphan)
        assert state is not None and state[1] == g.pid, "the daemon is the orphan's subreaper"
        assert wait_until(lambda: proc_state(orphan) is None, timeout=5), "orphan left as a zombie"
        for _ in range(5):
            run(g, cmd="sleep 0.05 & sleep 0.05 & exit 3")
        assert run(g, argv=["/no/such/binary"]).error["code"] == "not_found"
        assert run(g, cmd="exit 5").result["exit_code"] == 5
        assert wait_until(lambda: [c for c in children_of(g.pid) if c[1] == "Z"] == [], timeout=5)
    finally:
        g.close()


def test_host_hangup_kills_process_groups() -> None:
    g = Guest()
    process_id = start_background(g, argv=["sleep", "60"])
    pid = next(p["pid"] for p in g.call("process.list").result["processes"] if p["process_id"] == process_id)
    g.close()
    assert wait_until(lambda: proc_state(pid) is None or proc_state(pid)[0] == "Z")  # type: ignore[index]


def test_many_concurrent_calls(guest: Guest) -> None:
    streams = {guest.open("process.start", {"argv": ["echo", str(index)]}): index for index in range(40)}
    pings = [guest.open("sys.ping") for _ in range(10)]
    for stream, index in streams.items():
        reply = guest.collect(stream)
        assert reply.result["exit_code"] == 0 and reply.stdout == f"{index}\n".encode()
    assert all(guest.collect(stream).ok for stream in pings)


def test_input_without_stdin_is_refused(guest: Guest) -> None:
    process_id = start_background(guest, argv=["sleep", "5"])
    stream = guest.open("process.input", {"process_id": process_id})
    guest.send_body(stream, b"nobody reads this")
    assert guest.collect(stream).error["code"] == "invalid_argument"
    guest.call("process.signal", {"process_id": process_id, "signal": "KILL"})
