"""Serving the E2B front beside SPACE's API (space.controlplane.e2b.serve) and announcing it (`space up`):
an E2B server whose port is taken is logged and the API goes on; the main server's end stops the E2B
servers; `space up` prints E2B_API_URL and E2B_SANDBOX_URL beside SPACE_URL."""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from space.cli import status, up
from space.controlplane.e2b.serve import _companion, parse_listen, serve_with_e2b
from space.controlplane.local import LocalCluster
from space.controlplane.supervisor import STATUS_FILENAME
from space.core import errors
from tests.support.cluster import free_port


def _app(answer: str) -> FastAPI:
    app = FastAPI()
    app.add_api_route("/", lambda: {"app": answer}, methods=["GET"])
    return app


def test_a_taken_e2b_port_leaves_the_api_serving_and_the_api_s_end_stops_the_rest() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    api_port, e2b_port = free_port(), free_port()
    main = uvicorn.Server(uvicorn.Config(_app("space"), host="127.0.0.1", port=api_port, log_level="error"))
    busy = _companion(
        _app("busy"), f"127.0.0.1:{taken.getsockname()[1]}", "x", lifespan="off", log_level="critical"
    )
    e2b = _companion(_app("e2b"), f"127.0.0.1:{e2b_port}", "y", lifespan="off", log_level="error")

    async def scenario() -> None:
        serving = asyncio.create_task(serve_with_e2b(main, [busy, e2b]))
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                if main.started and e2b.started:
                    break
                await asyncio.sleep(0.05)
            assert (await client.get(f"http://127.0.0.1:{api_port}/")).json() == {"app": "space"}
            assert (await client.get(f"http://127.0.0.1:{e2b_port}/")).json() == {"app": "e2b"}
        main.should_exit = True  # what SIGTERM does to the main server
        await asyncio.wait_for(serving, 30)
        assert not busy.started and e2b.should_exit

    try:
        asyncio.run(scenario())
    finally:
        taken.close()


def test_listen_addresses_are_checked() -> None:
    assert parse_listen("127.0.0.1:8471", "f") == ("127.0.0.1", 8471)
    assert parse_listen("[::1]:8471", "f") == ("::1", 8471)
    for bad in ("8471", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", "h:x", ":80"):
        with pytest.raises(errors.InvalidArgument):
            parse_listen(bad, "f")


def test_space_up_announces_the_e2b_urls(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SPACE_CONFIG", str(tmp_path / "config.json"))  # never the real one
    cluster = LocalCluster(tmp_path, port=9470, e2b_api_port=9471, e2b_sandbox_port=9472)
    cluster.api_key = "space_k"
    up._announce(cluster)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "SPACE_URL=http://127.0.0.1:9470",
        "SPACE_CONSOLE_URL=http://127.0.0.1:9470/console/",
        "SPACE_API_KEY=space_k",
        "E2B_API_URL=http://127.0.0.1:9471",
        "E2B_SANDBOX_URL=http://127.0.0.1:9472",
    ]
    off = LocalCluster(tmp_path, port=9470)
    off.api_key = "space_k"
    up._announce(off)
    assert "E2B" not in capsys.readouterr().out
    described = up._described(tmp_path, {"port": 9470, "e2b_ports": [9471, 9472]})
    assert (described.e2b_api_url, described.e2b_sandbox_url) == (
        "http://127.0.0.1:9471",
        "http://127.0.0.1:9472",
    )


def test_space_status_shows_the_e2b_front(tmp_path: pathlib.Path) -> None:
    api = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    recorded = {"url": "http://127.0.0.1:1", "e2b_api_url": api, "e2b_sandbox_url": "http://127.0.0.1:2"}
    (tmp_path / STATUS_FILENAME).write_text(json.dumps({**recorded, "components": []}))
    report = status.collect(tmp_path)  # no supervisor runs
    assert report["e2b"] == {"health": "not running", "api_url": api, "sandbox_url": "http://127.0.0.1:2"}
    assert f"E2B front: not running (E2B_API_URL={api}" in status.render(report)
    assert status._e2b(recorded, running=True)["health"] == "unreachable"
    assert status.collect(tmp_path / "nothing")["e2b"] == {"health": "not served"}
