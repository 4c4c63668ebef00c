"""The node RPC as its own process (`python -m space.node.agent.server --driver fake`): 50 MiB go up and come
back streamed while the server's peak memory stays far below the file's size; an unreachable control plane
is not fatal; SIGTERM stops it cleanly. Plus the registration/heartbeat loop against a mock control plane."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from space.core.ids import new_sandbox_id
from space.node.agent.agent import NodeAgent
from space.node.agent.identity import NodeIdentity
from space.node.agent.registration import report_to_control_plane
from space.node.agent.service import NodeService
from space.node.drivers.fake import FakeDriver
from tests.support.node_capability import NodeAuth

MiB = 1 << 20
TOKEN = "streaming-test-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_status_kib(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def reset_peak(pid: int) -> None:
    """Peak RSS (VmHWM) back to the current RSS (Linux >= 4.0)."""
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    data_dir = tmp_path_factory.mktemp("node-proc")
    token_file = data_dir / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    log = open(data_dir / "server.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "space.node.agent.server", "--driver", "fake", "--data-dir", str(data_dir),
         "--listen", f"127.0.0.1:{port}", "--rpc-token-file", str(token_file),
         "--control-plane", "http://127.0.0.1:9", "--log-level", "warning"],
        stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, (data_dir / "server.log").read_text()
        try:
            if (
                httpx.get(f"{url}/node/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}).status_code
                == 200
            ):
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "node RPC did not come up"
        time.sleep(0.05)
    try:
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0, (data_dir / "server.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        # SIGTERM ended the fake sandboxes too (the agent closes its driver on the way out)
        assert "Traceback" not in (data_dir / "server.log").read_text()


def test_50_mib_up_and_down_without_holding_the_file(server: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = server
    size = 50 * MiB
    chunk = os.urandom(MiB)
    with httpx.Client(base_url=url, auth=NodeAuth(TOKEN), timeout=120) as http:
        sandbox_id = new_sandbox_id()
        assert http.put(f"/node/v1/sandboxes/{sandbox_id}", json={}).status_code == 201
        files = f"/node/v1/sandboxes/{sandbox_id}/files"
        # warm up the code paths, so their one-time allocations are not counted
        http.put(files, params={"path": "warm.bin"}, content=chunk)
        assert http.get(files, params={"path": "warm.bin"}).content == chunk

        def body() -> Iterator[bytes]:
            for i in range(size // MiB):
                yield chunk[i:] + chunk[:i]  # 50 distinct MiB, produced lazily

        expected = hashlib.sha256()
        for piece in body():
            expected.update(piece)

        reset_peak(proc.pid)
        base = proc_status_kib(proc.pid, "VmRSS")
        answer = http.put(files, params={"path": "big.bin"}, content=body())
        assert answer.status_code == 200 and answer.json() == {"size": size}, answer.text
        upload_peak = proc_status_kib(proc.pid, "VmHWM") - base

        reset_peak(proc.pid)
        base = proc_status_kib(proc.pid, "VmRSS")
        got = hashlib.sha256()
        received = 0
        with http.stream("GET", files, params={"path": "big.bin"}) as response:
            assert response.status_code == 200
            for piece in response.iter_raw(256 * 1024):
                got.update(piece)
                received += len(piece)
        download_peak = proc_status_kib(proc.pid, "VmHWM") - base
        assert (received, got.hexdigest()) == (size, expected.hexdigest())

        stat = http.get(f"{files}/stat", params={"path": "big.bin"}).json()
        assert stat["size"] == size
    # the server never held the file: its peak grew by a small fraction of 50 MiB
    assert upload_peak < 16 * 1024, f"upload raised the server's peak RSS by {upload_peak} KiB"
    assert download_peak < 16 * 1024, f"download raised the server's peak RSS by {download_peak} KiB"


def test_abandoned_download_and_upload_leave_no_open_calls(
    server: tuple[subprocess.Popen[bytes], str],
) -> None:
    _, url = server
    with httpx.Client(base_url=url, auth=NodeAuth(TOKEN), timeout=60) as http:
        sandbox_id = new_sandbox_id()
        http.put(f"/node/v1/sandboxes/{sandbox_id}", json={})
        files = f"/node/v1/sandboxes/{sandbox_id}/files"
        http.put(files, params={"path": "big.bin"}, content=b"z" * (12 * MiB))
        for _ in range(3):
            with http.stream("GET", files, params={"path": "big.bin"}) as response:
                next(response.iter_raw(65536))  # read a little, then hang up
        # an upload that breaks off does not leave a half-written file behind
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(
                f"PUT {files}?path=partial.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Length: {10 * MiB}\r\n\r\n".encode()
                + b"p" * MiB
            )
            time.sleep(0.2)
        time.sleep(0.3)
        assert http.get(f"{files}/stat", params={"path": "partial.bin"}).status_code == 404
        # the sandbox still answers normally
        result = http.post(f"/node/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "echo ok"}).json()
        assert result["stdout"] == "ok\n"


def test_registration_and_heartbeats_survive_control_plane_failures(tmp_path: pathlib.Path) -> None:
    seen: list[tuple[str, dict[str, Any], str]] = []
    failures = {"register": 1, "heartbeat": 1}
    issued: list[str] = []  # the per-node identity of each enrolment

    def control_plane(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body, request.headers.get("authorization", "")))
        if request.url.path == "/v1/nodes/register":
            if failures["register"]:
                failures["register"] -= 1
                return httpx.Response(503)
            issued.append(f"identity-{len(issued)}")
            return httpx.Response(201, json={"node_id": "node-x", "identity": issued[-1]})
        if request.headers.get("authorization") != f"Bearer {issued[-1]}":
            return httpx.Response(401)  # only the enrolment's identity is good
        if request.url.path == "/v1/nodes/node-x/register":
            return httpx.Response(200, json={"node_id": "node-x"})
        if failures["heartbeat"]:
            failures["heartbeat"] -= 1
            return httpx.Response(404)  # "unknown node": the agent registers again
        return httpx.Response(200, json={})

    async def scenario() -> None:
        agent = NodeAgent(FakeDriver(tmp_path))
        await agent.prepare()
        handle = await agent.create()
        service = NodeService(agent)
        service.identity = NodeIdentity.load(tmp_path / "identity" / "node.json")
        service.touch(handle.sandbox_id)  # as a data-plane request would
        task = asyncio.create_task(
            report_to_control_plane(
                service, "http://cp", "boot-token", "http://node:7070", "rpc-token",
                interval=0.01, transport=httpx.MockTransport(control_plane),
            )
        )  # fmt: skip
        try:
            for _ in range(500):
                if sum(path.endswith("/heartbeat") for path, _, _ in seen) >= 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await agent.delete_all()
            await agent.close()
        beats = [body for path, body, _ in seen if path == "/v1/nodes/node-x/heartbeat"]
        assert len(beats) >= 3
        assert [path for path, _, _ in seen[:4]] == [
            "/v1/nodes/register", "/v1/nodes/register", "/v1/nodes/node-x/heartbeat",
            "/v1/nodes/node-x/register",
        ]  # fmt: skip
        register = seen[0][1]
        assert (register["url"], register["token"], register["templates"]) == (
            "http://node:7070", "rpc-token", ["python"],
        )  # fmt: skip
        assert register["capacity"]["cpus"] >= 1 and register["driver"] == "fake"
        # The bootstrap token only enrols (once); re-registration and heartbeats carry the identity.
        assert [auth for path, _, auth in seen if path == "/v1/nodes/register"] == ["Bearer boot-token"] * 2
        assert {auth for path, _, auth in seen if path != "/v1/nodes/register"} == {"Bearer identity-0"}
        assert seen[3][1]["token"] == "rpc-token"  # re-registration carries the RPC token again
        assert len(issued) == 1 and service.identity.node_id == "node-x"
        assert service.identity.secret == issued[-1] and service.node_id == "node-x"
        # Persisted (0600) for the next start of the agent.
        persisted = tmp_path / "identity" / "node.json"
        assert persisted.stat().st_mode & 0o777 == 0o600
        assert NodeIdentity.load(persisted) == service.identity
        last = beats[-1]
        assert last["node_id"] == "node-x" and last["sandbox_count"] == 1
        assert last["capacity"]["cpus"] >= 1 and last["used"]["memory_mb"] == 512
        assert [s["id"] for s in last["sandboxes"]] == [handle.sandbox_id]
        assert last["sandboxes"][0]["state"] == "running"
        assert set(last["activity"]) == {handle.sandbox_id}

    asyncio.run(scenario())
