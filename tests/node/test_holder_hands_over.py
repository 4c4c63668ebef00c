"""A holder's end (ADR 0088): it records how its runtime ended and removes its socket only while that socket
is still the one it bound. A discarded runtime's socket is unlinked by the helper before its processes are
killed, and the next incarnation's holder may have bound its own at the same path before this one has
reaped its processes: the old holder must then leave the run directory alone (no exit record, the
successor's socket untouched). Real holder processes, with a short-lived shell as their runtime."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import time
from collections.abc import Callable

import pytest

from space.node.helper import holder
from space.node.helper.runtime import Runtimes

RUNTIME_S = 0.6


def _run_holder(run_dir: pathlib.Path, meddle: Callable[[pathlib.Path], None]) -> None:
    """A holder whose runtime lives RUNTIME_S; `meddle` acts on its socket once it is there."""
    socket_path = run_dir / "channel.sock"
    job = holder.encode_assignment(
        str(socket_path), os.getuid(), str(run_dir / "runtime.log"), ["sh", "-c", f"sleep {RUNTIME_S}"]
    )
    proc = subprocess.Popen(Runtimes.holder_argv(), stdin=subprocess.PIPE)  # a spare, as the helper starts
    try:
        assert proc.stdin is not None
        proc.stdin.write(job)
        proc.stdin.close()
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            assert proc.poll() is None, "the holder ended before binding its socket"
            assert time.monotonic() < deadline, "the holder never bound its socket"
            time.sleep(0.005)
        meddle(socket_path)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_an_undisturbed_holder_records_the_end_and_removes_its_socket(tmp_path: pathlib.Path) -> None:
    _run_holder(tmp_path, lambda _path: None)
    assert json.loads((tmp_path / "exit.json").read_text())["exit_code"] == 0
    assert not (tmp_path / "channel.sock").exists()


def test_a_discarded_holder_writes_no_exit_record(tmp_path: pathlib.Path) -> None:
    _run_holder(tmp_path, lambda path: path.unlink())
    assert not (tmp_path / "exit.json").exists()
    assert not (tmp_path / "channel.sock").exists()


def test_a_discarded_holder_leaves_its_successors_socket_alone(tmp_path: pathlib.Path) -> None:
    successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def replace(path: pathlib.Path) -> None:
        path.unlink()
        successor.bind(str(path))
        successor.listen(1)

    try:
        _run_holder(tmp_path, replace)
        assert not (tmp_path / "exit.json").exists()
        assert (tmp_path / "channel.sock").exists()
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            client.connect(str(tmp_path / "channel.sock"))  # still the successor's, listening
    finally:
        successor.close()


@pytest.mark.parametrize("meddle", ["unlink", "replace"])
def test_owning_is_judged_by_the_socket_file_itself(tmp_path: pathlib.Path, meddle: str) -> None:
    """The rule without processes: the socket at the path is ours only while it is the file bound."""
    keeper = holder.Holder(str(tmp_path / "channel.sock"), os.getuid(), ["true"], str(tmp_path / "log"))
    listener = keeper._listen()
    try:
        assert keeper._owns_run_dir()
        (tmp_path / "channel.sock").unlink()
        if meddle == "replace":
            (tmp_path / "channel.sock").write_bytes(b"")
        assert not keeper._owns_run_dir()
    finally:
        listener.close()
