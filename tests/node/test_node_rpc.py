"""The node agent's RPC over the fake driver, through a real uvicorn on 127.0.0.1 (no root): auth, idempotent
lifecycle repeats, statuses of errors, the data plane (exec, processes, files, watch, PTY), auto-resume,
snapshots/fork, and NodeClient's typed errors."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from space.core import errors
from space.core.ids import new_sandbox_id
from space.node.drivers.fake import FakeDriver
from space.node.rpc_client import NodeClient
from tests.support.node_rpc import TOKEN, Rpc, fake_node_rpc


@pytest.fixture(scope="module")
def rpc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rpc]:
    with fake_node_rpc(tmp_path_factory.mktemp("node")) as served:
        yield served


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"code", "message", "details"} <= set(body["error"])
    return dict(body["error"])


ROUTES_TO_PROBE = (
    ("GET", "/node/v1/info"),
    ("PUT", f"/node/v1/sandboxes/{new_sandbox_id()}"),
    ("GET", "/node/v1/no-such-route"),
    ("GET", "/node/v1/openapi.json"),
)


# -- auth ----------------------------------------------------------------------------------------------------
def test_every_route_requires_the_node_token(rpc: Rpc) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, path in ROUTES_TO_PROBE:
            response = httpx.request(method, rpc.url + path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert error_of(response)["code"] == "unauthenticated"
    # WebSocket too: refused before any sandbox is looked at
    bad = NodeClient(rpc.url, "wrong")
    with pytest.raises(InvalidStatus) as refused:
        rpc.run(_open_pty(bad, new_sandbox_id()))
    assert refused.value.response.status_code in {401, 403}  # 401 where the server supports denial bodies
    rpc.run(bad.aclose())
    # with the token an unknown route is a typed 404
    response = rpc.http.get("/node/v1/no-such-route")
    assert (response.status_code, error_of(response)["code"]) == (404, "not_found")
    assert rpc.http.get("/node/v1/openapi.json").status_code == 200


async def _open_pty(client: NodeClient, sandbox_id: str) -> None:
    async with client.pty(sandbox_id) as ws:
        await ws.recv()


# -- lifecycle -----------------------------------------------------------------------------------------------
def test_lifecycle_calls_are_idempotent(rpc: Rpc) -> None:
    sandbox_id = new_sandbox_id()
    body = {"template": "python", "env": {"K": "V"}, "limits": {"cpus": 0.5, "memory_mb": 256}}
    first = rpc.http.put(f"/node/v1/sandboxes/{sandbox_id}", json=body)
    assert first.status_code == 201, first.text
    assert (first.json()["id"], first.json()["state"]) == (sandbox_id, "running")
    assert first.json()["limits"]["cpus"] == 0.5
    again = rpc.http.put(f"/node/v1/sandboxes/{sandbox_id}", json=body)
    assert (again.status_code, again.json()["state"]) == (200, "running")

    for action, state in (("pause", "paused"), ("resume", "running"), ("stop", "stopped"),
                          ("start", "running")):  # fmt: skip
        for _ in range(2):  # a reconciler repeating the call after a crash gets the same answer
            response = rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/{action}")
            assert (response.status_code, response.json()["state"]) == (200, state), response.text

    # the env reached the sandbox
    assert rpc.run(rpc.client.exec(sandbox_id, 'printf "$K"')).stdout == "V"

    # observed state: in the list, with the channel open and activity recorded
    listed = rpc.run(rpc.client.list_sandboxes())
    mine = next(s for s in listed.sandboxes if s.id == sandbox_id)
    assert (mine.state, mine.runtime, mine.channel_open) == ("running", "running", True)
    assert mine.last_activity_at is not None and mine.guest is not None
    assert mine.guest["running_processes"] == 0
    info = rpc.run(rpc.client.info())
    assert info.sandbox_count >= 1 and info.used.cpus >= 0.5 and info.capacity.cpus >= 1
    assert (info.driver, info.isolating) == ("fake", False)

    first_delete = rpc.http.delete(f"/node/v1/sandboxes/{sandbox_id}")
    assert (first_delete.status_code, first_delete.json()) == (
        200, {"id": sandbox_id, "state": "deleted", "existed": True},
    )  # fmt: skip
    second_delete = rpc.http.delete(f"/node/v1/sandboxes/{sandbox_id}")
    assert (second_delete.status_code, second_delete.json()["existed"]) == (200, False)
    assert rpc.http.get(f"/node/v1/sandboxes/{sandbox_id}").status_code == 404


def test_concurrent_repeats_converge(rpc: Rpc) -> None:
    sandbox_id = new_sandbox_id()

    async def scenario() -> list[bool]:
        results = await asyncio.gather(*(rpc.client.create_sandbox(sandbox_id) for _ in range(3)))
        await asyncio.gather(*(rpc.client.pause(sandbox_id) for _ in range(3)))
        assert (await rpc.client.get_sandbox(sandbox_id)).state == "paused"
        await asyncio.gather(*(rpc.client.delete_sandbox(sandbox_id) for _ in range(3)))
        return [created for _, created in results]

    assert sorted(rpc.run(scenario())) == [False, False, True]
    assert sandbox_id not in rpc.agent.sandboxes


def test_errors_have_their_statuses_and_types(rpc: Rpc) -> None:
    unknown = new_sandbox_id()
    response = rpc.http.post(f"/node/v1/sandboxes/{unknown}/pause")
    assert (response.status_code, error_of(response)["code"]) == (404, "not_found")
    response = rpc.http.post(f"/node/v1/sandboxes/{unknown}/exec", json={"cmd": "true"})
    assert response.status_code == 404
    response = rpc.http.get("/node/v1/sandboxes/not-an-id")
    assert (response.status_code, error_of(response)["code"]) == (400, "invalid_argument")

    sandbox_id = rpc.new()
    rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/stop")
    response = rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/pause")
    error = error_of(response)
    assert (response.status_code, error["code"], error["details"]["state"]) == (
        409,
        "invalid_state",
        "stopped",
    )
    response = rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "true"})
    assert (response.status_code, error_of(response)["details"]["state"]) == (409, "stopped")
    with pytest.raises(errors.InvalidState) as caught:  # the client rebuilds the typed error
        rpc.run(rpc.client.resume(sandbox_id))
    assert caught.value.state == "stopped"

    response = rpc.http.put(f"/node/v1/sandboxes/{new_sandbox_id()}", json={"limits": {"cpus": 1000}})
    error = error_of(response)
    assert (response.status_code, error["code"]) == (422, "validation_error")
    assert error["details"]["fields"] == ["limits.cpus"]
    response = rpc.http.put(f"/node/v1/sandboxes/{new_sandbox_id()}", json={"tempalte": "python"})
    assert (response.status_code, error_of(response)["details"]["fields"]) == (422, ["tempalte"])
    rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/start")
    response = rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "x", "argv": ["y"]})
    assert response.status_code == 422
    response = rpc.http.get(f"/node/v1/sandboxes/{sandbox_id}/files", params={"path": "/nope/missing"})
    assert (response.status_code, error_of(response)["code"]) == (404, "not_found")
    response = rpc.http.get(f"/node/v1/sandboxes/{sandbox_id}/files")
    assert (response.status_code, error_of(response)["details"]["fields"]) == (422, ["path"])
    with pytest.raises(errors.NotFound):
        rpc.run(rpc.client.attach(sandbox_id, "no-such-process").__anext__())


# -- data plane ----------------------------------------------------------------------------------------------
def test_exec_json_and_ndjson(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    result = rpc.run(rpc.client.exec(sandbox_id, "echo out; echo err >&2; exit 3"))
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    assert result.stdout_bytes == b"out\n" and result.process_id
    result = rpc.run(rpc.client.exec(sandbox_id, ["cat"], stdin=b"\x00\xffpiped"))
    assert result.stdout_bytes == b"\x00\xffpiped"

    async def stream() -> list[dict[str, Any]]:
        return [e async for e in rpc.client.exec_stream(sandbox_id, "echo a; sleep 0.1; echo b >&2; exit 4")]

    events = rpc.run(stream())
    assert events[0]["type"] == "started" and events[0]["process_id"]
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 4
    out = b"".join(base64.b64decode(e["data_b64"]) for e in events if e["type"] == "stdout")
    err = b"".join(base64.b64decode(e["data_b64"]) for e in events if e["type"] == "stderr")
    assert (out, err) == (b"a\n", b"b\n")
    # raw: NDJSON content type, one JSON object per line
    response = rpc.http.post(f"/node/v1/sandboxes/{sandbox_id}/exec", json={"argv": ["true"], "stream": True})
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert [json.loads(line)["type"] for line in response.text.splitlines()] == ["started", "exit"]


def test_data_plane_request_resumes_a_paused_sandbox(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    before = rpc.run(rpc.client.get_sandbox(sandbox_id)).last_activity_at
    rpc.run(rpc.client.pause(sandbox_id))
    assert rpc.run(rpc.client.get_sandbox(sandbox_id)).state == "paused"
    time.sleep(0.01)
    result = rpc.run(rpc.client.exec(sandbox_id, "echo awake"))
    assert result.stdout == "awake\n"
    observed = rpc.run(rpc.client.get_sandbox(sandbox_id))
    assert observed.state == "running"
    assert observed.last_activity_at is not None and (before is None or observed.last_activity_at > before)
    # concurrent requests to a paused sandbox resume it once and all succeed
    rpc.run(rpc.client.pause(sandbox_id))

    async def many() -> list[str]:
        answers = await asyncio.gather(*(rpc.client.exec(sandbox_id, f"echo {i}") for i in range(5)))
        return [a.stdout for a in answers]

    assert rpc.run(many()) == [f"{i}\n" for i in range(5)]


def test_background_processes_attach_stdin_signal(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    started = rpc.run(rpc.client.start_process(sandbox_id, ["cat"], stdin=True, tag="echo"))
    assert started.process_id and started.pid
    assert rpc.run(rpc.client.write_stdin(sandbox_id, started.process_id, b"hello ")) == 6

    async def body() -> Any:
        yield b"world"
        yield b"\n"

    assert rpc.run(rpc.client.write_stdin(sandbox_id, started.process_id, body(), eof=True)) == 6

    async def attach() -> list[dict[str, Any]]:
        return [e async for e in rpc.client.attach(sandbox_id, started.process_id, offset=0)]

    events = rpc.run(attach())
    assert events[0]["type"] == "attached"
    assert b"".join(base64.b64decode(e["data_b64"]) for e in events if "data_b64" in e) == b"hello world\n"
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0

    sleeper = rpc.run(rpc.client.start_process(sandbox_id, "sleep 30", tag="sleeper"))
    listed = rpc.run(rpc.client.list_processes(sandbox_id))
    assert any(p["process_id"] == sleeper.process_id and p["running"] for p in listed)
    rpc.run(rpc.client.signal(sandbox_id, sleeper.process_id, "SIGKILL"))
    last = rpc.run(attach_last(rpc.client, sandbox_id, sleeper.process_id))
    assert last["type"] == "exit" and last["signal"] == 9
    # not following: what is buffered, then an end marker
    events = rpc.run(_collect(rpc.client.attach(sandbox_id, started.process_id, offset=6, follow=False)))
    assert events[-1]["type"] == "end" and events[-1]["running"] is False


async def attach_last(client: NodeClient, sandbox_id: str, process_id: str) -> dict[str, Any]:
    return (await _collect(client.attach(sandbox_id, process_id)))[-1]


async def _collect(events: Any) -> list[dict[str, Any]]:
    return [e async for e in events]


def test_files_round_trip_and_directory_operations(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    c = rpc.client
    assert rpc.run(c.write_file(sandbox_id, "notes/a.txt", b"alpha", mode=0o600)) == 5
    assert rpc.run(c.read_file(sandbox_id, "notes/a.txt")) == b"alpha"
    assert rpc.run(c.read_file(sandbox_id, "notes/a.txt", offset=1, length=3)) == b"lph"
    assert rpc.run(c.write_file(sandbox_id, "empty", b"")) == 0
    assert rpc.run(c.read_file(sandbox_id, "empty")) == b""
    rpc.run(c.mkdir(sandbox_id, "d1/d2"))
    rpc.run(c.rename(sandbox_id, "notes/a.txt", "d1/d2/b.txt"))
    assert [e["name"] for e in rpc.run(c.list_files(sandbox_id, "d1/d2"))] == ["b.txt"]
    stat = rpc.run(c.stat(sandbox_id, "d1/d2/b.txt"))
    assert (stat["type"], stat["size"], stat["mode"] & 0o777) == ("file", 5, 0o600)
    with pytest.raises(errors.SpaceError):
        rpc.run(c.remove(sandbox_id, "d1"))  # not empty without recursive
    rpc.run(c.remove(sandbox_id, "d1", recursive=True))
    with pytest.raises(errors.NotFound):
        rpc.run(c.stat(sandbox_id, "d1"))
    # raw: the download is octet-stream
    rpc.run(c.write_file(sandbox_id, "raw.bin", bytes(range(256))))
    response = rpc.http.get(f"/node/v1/sandboxes/{sandbox_id}/files", params={"path": "raw.bin"})
    assert (response.headers["content-type"], response.content) == (
        "application/octet-stream",
        bytes(range(256)),
    )


def test_file_fidelity_depth_mkdir_move_and_xattrs(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    c = rpc.client
    rpc.run(c.write_file(sandbox_id, "tree/a/deep/f.txt", b"12345"))
    rpc.run(c.write_file(sandbox_id, "tree/b.txt", b""))
    listing = rpc.run(c.list_dir(sandbox_id, "tree", depth=3))
    paths = [e["path"].split("/tree/", 1)[1] for e in listing.entries]
    assert paths == ["a", "a/deep", "a/deep/f.txt", "b.txt"] and not listing.truncated
    cut = rpc.run(c.list_dir(sandbox_id, "tree", depth=3, limit=2))
    assert len(cut.entries) == 2 and cut.truncated
    for bad in ({"depth": 0}, {"depth": 17}, {"limit": 0}, {"limit": 50_001}):
        answer = rpc.http.get(f"/node/v1/sandboxes/{sandbox_id}/files/list", params={"path": "tree", **bad})
        assert answer.status_code == 422, (bad, answer.text)
    entry = rpc.run(c.stat(sandbox_id, "tree/b.txt"))
    assert entry["permissions"] == "-rw-r--r--" and entry["owner"] and entry["group"]
    made = rpc.run(c.mkdir(sandbox_id, "tree/new"))
    assert made.created and made.entry["type"] == "dir"
    assert not rpc.run(c.mkdir(sandbox_id, "tree/new")).created
    with pytest.raises(errors.AlreadyExists):
        rpc.run(c.mkdir(sandbox_id, "tree/new", parents=False))
    moved = rpc.run(c.rename(sandbox_id, "tree/b.txt", "elsewhere/x/b.txt", parents=True))
    assert moved["path"].endswith("/elsewhere/x/b.txt") and moved["type"] == "file"
    try:
        rpc.run(c.set_xattr(sandbox_id, "tree/a/deep/f.txt", "user.e2b.k", b"v\x00"))
    except errors.InvalidArgument as exc:  # the host's test directory cannot hold user attributes
        assert exc.details["reason"] == "xattrs_not_supported"
    else:
        assert rpc.run(c.get_xattr(sandbox_id, "tree/a/deep/f.txt", "user.e2b.k")) == b"v\x00"
        assert rpc.run(c.xattrs(sandbox_id, "tree/a/deep/f.txt")) == {"user.e2b.k": b"v\x00"}
        rpc.run(c.remove_xattr(sandbox_id, "tree/a/deep/f.txt", "user.e2b.k"))
        with pytest.raises(errors.NotFound):
            rpc.run(c.get_xattr(sandbox_id, "tree/a/deep/f.txt", "user.e2b.k"))
    for name in ("trusted.x", "security.capability", "user.", "user." + "n" * 300):
        with pytest.raises(errors.InvalidArgument):
            rpc.run(c.get_xattr(sandbox_id, "tree/a/deep/f.txt", name))
        with pytest.raises(errors.InvalidArgument):
            rpc.run(c.set_xattr(sandbox_id, "tree/a/deep/f.txt", name, b"v"))
    with pytest.raises(errors.InvalidArgument):  # 64 KiB is the most a value may hold
        rpc.run(c.set_xattr(sandbox_id, "tree/a/deep/f.txt", "user.big", b"v" * 65537))


def test_resize_by_process_id(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    c = rpc.client
    terminal = rpc.run(c.start_process(sandbox_id, "sleep 30", pty=(24, 80)))
    plain = rpc.run(c.start_process(sandbox_id, "sleep 30"))
    rpc.run(c.resize(sandbox_id, terminal.process_id, 50, 132))
    with pytest.raises(errors.InvalidState) as refused:  # no terminal: 409 naming the state
        rpc.run(c.resize(sandbox_id, plain.process_id, 50, 132))
    assert refused.value.state == "no_terminal"
    with pytest.raises(errors.NotFound):
        rpc.run(c.resize(sandbox_id, "0123456789abcdef", 50, 132))
    url = f"/node/v1/sandboxes/{sandbox_id}/processes/{terminal.process_id}/resize"
    for rows, cols in ((0, 80), (24, 0), (1001, 80), (24, 10**9), (-1, -1), ("24", 80), (True, 80)):
        answer = rpc.http.post(url, json={"rows": rows, "cols": cols})
        assert answer.status_code == 422, (rows, cols, answer.text)
    for process in (terminal, plain):
        rpc.run(c.signal(sandbox_id, process.process_id, "KILL"))


def test_watch_streams_changes(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    rpc.run(rpc.client.mkdir(sandbox_id, "watched"))

    async def scenario() -> list[dict[str, Any]]:
        seen: list[dict[str, Any]] = []
        stream = rpc.client.watch(sandbox_id, "watched")
        async for event in stream:
            seen.append(event)
            if event["type"] == "watching":
                await rpc.client.write_file(sandbox_id, "watched/new.txt", b"x")
            if event["type"] == "changes":
                break
        await stream.aclose()  # type: ignore[attr-defined]
        return seen

    events = rpc.run(scenario())
    assert events[0]["type"] == "watching"
    assert any("new.txt" in change["path"] for change in events[-1]["changes"])


def test_pty_over_websocket(rpc: Rpc) -> None:
    sandbox_id = rpc.new()

    async def scenario() -> tuple[bytes, dict[str, Any]]:
        output = b""
        async with rpc.client.pty(sandbox_id, rows=30, cols=100, cmd="/bin/sh") as ws:
            started = json.loads(await ws.recv())
            assert started["type"] == "started"
            await ws.send(json.dumps({"resize": [40, 120]}))
            await ws.send(b"stty size; echo marker-$((6*7))\n")
            while b"marker-42" not in output:
                frame = await asyncio.wait_for(ws.recv(), 10)
                if isinstance(frame, bytes):
                    output += frame
            await ws.send(b"exit 5\n")
            while True:
                frame = await asyncio.wait_for(ws.recv(), 10)
                if isinstance(frame, str) and json.loads(frame)["type"] == "exit":
                    return output, json.loads(frame)
                if isinstance(frame, bytes):
                    output += frame

    output, exit_event = rpc.run(scenario())
    assert b"40 120" in output
    assert exit_event["exit_code"] == 5

    async def hang_up() -> list[dict[str, Any]]:
        async with rpc.client.pty(sandbox_id, cmd="/bin/sh") as ws:
            process_id = json.loads(await ws.recv())["process_id"]
        # the client went away: the terminal's shell got SIGHUP and ended
        for _ in range(100):
            listed = await rpc.client.list_processes(sandbox_id)
            mine = [p for p in listed if p["process_id"] == process_id]
            if mine and not mine[0]["running"]:
                return mine
            await asyncio.sleep(0.05)
        raise AssertionError(f"the PTY's shell kept running: {mine}")

    assert rpc.run(hang_up())[0]["signal"] == 1  # SIGHUP
    # a PTY on an unknown sandbox: an error frame, then a close code carrying the status
    with pytest.raises(ConnectionClosed) as caught:
        rpc.run(_pty_error(rpc.client, new_sandbox_id()))
    assert caught.value.rcvd is not None and caught.value.rcvd.code == 4404


async def _pty_error(client: NodeClient, sandbox_id: str) -> None:
    async with client.pty(sandbox_id) as ws:
        first = json.loads(await ws.recv())
        assert first["type"] == "error" and first["error"]["code"] == "not_found"
        await ws.recv()


# -- snapshots, rollback, fork -------------------------------------------------------------------------------
def test_snapshots_rollback_and_fork(rpc: Rpc) -> None:
    sandbox_id = rpc.new()
    c = rpc.client
    rpc.run(c.write_file(sandbox_id, "kept.txt", b"before"))
    disk = rpc.run(c.create_snapshot(sandbox_id))
    assert disk.kind == "disk" and disk.sandbox_id == sandbox_id
    rpc.run(c.write_file(sandbox_id, "kept.txt", b"after"))
    observed = rpc.run(c.rollback(sandbox_id, disk.snapshot_id))
    assert observed.state == "running"
    assert rpc.run(c.read_file(sandbox_id, "kept.txt")) == b"before"

    full = rpc.run(c.create_snapshot(sandbox_id, full=True, idempotency_key="k1"))
    assert full.kind == "full"
    again = rpc.run(c.create_snapshot(sandbox_id, full=True, idempotency_key="k1"))
    assert again.snapshot_id == full.snapshot_id  # replayed, not a second checkpoint
    with pytest.raises(errors.Conflict):
        rpc.run(c.create_snapshot(sandbox_id, full=False, idempotency_key="k1"))
    assert {s.snapshot_id for s in rpc.run(c.list_snapshots(sandbox_id))} == {
        disk.snapshot_id,
        full.snapshot_id,
    }

    child_ids = [new_sandbox_id(), new_sandbox_id()]
    children = rpc.run(c.fork(sandbox_id, count=2, snapshot_id=full.snapshot_id, child_ids=child_ids))
    assert [ch.id for ch in children] == child_ids and {ch.state for ch in children} == {"running"}
    repeat = rpc.run(c.fork(sandbox_id, count=2, snapshot_id=full.snapshot_id, child_ids=child_ids))
    assert [ch.id for ch in repeat] == child_ids  # idempotent: the same children, no new ones
    assert rpc.run(c.read_file(child_ids[0], "kept.txt")) == b"before"
    fresh = rpc.run(c.fork(sandbox_id))  # node-chosen id, from a checkpoint taken now
    assert len(fresh) == 1 and fresh[0].id not in child_ids

    rpc.run(c.delete_snapshot(sandbox_id, disk.snapshot_id))
    rpc.run(c.delete_snapshot(sandbox_id, disk.snapshot_id))  # repeat: fine
    assert disk.snapshot_id not in {s.snapshot_id for s in rpc.run(c.list_snapshots(sandbox_id))}
    with pytest.raises(errors.NotFound):
        rpc.run(c.rollback(sandbox_id, disk.snapshot_id))
    for child in [*child_ids, fresh[0].id]:
        rpc.run(c.delete_sandbox(child))


def test_delete_removes_driver_leftovers_of_an_unknown_sandbox(rpc: Rpc) -> None:
    driver = rpc.agent.driver
    assert isinstance(driver, FakeDriver)
    orphan = new_sandbox_id()
    (driver.base_dir / "sandboxes" / orphan / "work").mkdir(parents=True)
    assert orphan in rpc.run(rpc.client.list_sandboxes(guest=False)).unmanaged
    assert rpc.run(rpc.client.delete_sandbox(orphan)).existed is False
    assert not (driver.base_dir / "sandboxes" / orphan).exists()
    assert orphan not in rpc.run(rpc.client.list_sandboxes(guest=False)).unmanaged
