"""The web console's server side (ADR 0061) against a real control plane (fake driver): its static files
with their security headers, attacked with traversal and unknown paths sent raw (no client normalises them);
the vendored files equal to their pins; `whoami`, the organisation-only nodes list, the live sandbox stream
scoped to the key's project, and the PTY's key subprotocol (a browser cannot set WebSocket headers)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import pathlib
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.support import cluster as c

fake_cluster = c.fake_cluster
project = c.project
ROOT = pathlib.Path(__file__).resolve().parents[2]


def raw_get(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """GET `path` exactly as written (http.client sends it untouched: no dot-segment removal)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def test_console_files_come_with_a_strict_policy(fake_cluster: c.Cluster) -> None:
    status, headers, _ = raw_get(fake_cluster.url, "/console")
    assert status == 308 and headers["location"] == "/console/"
    status, headers, body = raw_get(fake_cluster.url, "/console/")
    assert status == 200 and b'<script type="module" src="js/app.js">' in body
    assert headers["content-type"].startswith("text/html")
    policy = headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["script-src"] == "'self'"  # no inline script, no eval
    assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'" and headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "no-referrer"
    assert b"<script>" not in body and b" on" not in body.replace(b" only", b"")  # no inline handlers
    for path, media in [
        ("/console/js/app.js", "text/javascript"),
        ("/console/console.css", "text/css"),
        ("/console/vendor/xterm/xterm.mjs", "text/javascript"),
        ("/console/vendor/xterm-addon-fit/addon-fit.mjs", "text/javascript"),
    ]:
        status, headers, body = raw_get(fake_cluster.url, path)
        assert status == 200 and headers["content-type"].startswith(media), (path, headers)
        assert headers["content-security-policy"] == policy and body


@pytest.mark.parametrize(
    "path",
    [
        "/console/../v1/whoami",
        "/console/%2e%2e/",
        "/console/%2e%2e/__init__.py",
        "/console/..%2f__init__.py",
        "/console/js/../../__init__.py",
        "/console/%2fetc%2fpasswd",
        "/console//etc/passwd",
        "/console/js/",
        "/console/vendor/",
        "/console/static/index.html",
        "/console/nothing.js",
        "/console/index.html%00.js",
    ],
)
def test_console_serves_only_its_files(fake_cluster: c.Cluster, path: str) -> None:
    status, headers, body = raw_get(fake_cluster.url, path)
    assert status == 404, (path, status, body[:200])
    assert b"import" not in body and b"root:" not in body and b"<html" not in body
    assert headers["content-security-policy"].startswith("default-src 'none'")


def test_vendored_files_match_their_pins() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "vendor_console.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (ROOT / "src/space/controlplane/console/static/vendor/xterm/LICENSE").is_file()


def test_whoami_and_the_nodes_list(fake_cluster: c.Cluster, project: c.Project) -> None:
    _, reader = project.new_key("read-only")
    me = project.http(reader).get("/v1/whoami").json()
    assert me["role"] == "read-only" and me["project_id"] == project.id and me["org_key"] is False
    assert reader not in json.dumps(me)
    assert project.http("space_not_a_key").get("/v1/whoami").status_code == 401
    refused = project.http().get("/v1/cluster/nodes")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    nodes = fake_cluster.http(fake_cluster.admin_key).get("/v1/cluster/nodes")
    assert nodes.status_code == 200, nodes.text
    listed = nodes.json()["nodes"]
    assert listed and {"id", "status", "capacity", "pools"} <= set(listed[0])
    text = nodes.text
    assert all(n.url not in text and n.rpc_token not in text for n in fake_cluster.nodes)


class Updates:
    """GET /v1/sandbox-updates read on a thread: the events it has sent so far."""

    def __init__(self, url: str, key: str) -> None:
        self.events: list[tuple[str, Any]] = []
        self.status: int | None = None
        self._client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with (
            contextlib.suppress(httpx.HTTPError),
            self._client.stream("GET", "/v1/sandbox-updates") as answer,
        ):
            self.status = answer.status_code
            kind = ""
            for line in answer.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    self.events.append((kind, json.loads(line[6:])))

    def wait(self, what: str, check: Any) -> Any:
        return c.wait_for(
            lambda: next((e for e in list(self.events) if check(e)), None), timeout=20, what=what
        )

    def close(self) -> None:
        self._client.close()


@pytest.fixture
def updates(fake_cluster: c.Cluster, project: c.Project) -> Iterator[Updates]:
    stream = Updates(fake_cluster.url, project.key)
    try:
        yield stream
    finally:
        stream.close()


def test_sandbox_updates_follow_the_project(
    fake_cluster: c.Cluster, project: c.Project, updates: Updates
) -> None:
    first = updates.wait("the first snapshot", lambda e: e[0] == "snapshot")
    assert first[1] == {"sandboxes": []}
    other = c.new_project(fake_cluster)
    try:
        with other.sdk() as sp:
            foreign = sp.sandboxes.create(limits=c.SMALL).id
        with project.sdk() as sp:
            sb = sp.sandboxes.create(limits=c.SMALL)
            updates.wait(
                "the new sandbox, running", lambda e: e[0] == "sandbox" and e[1]["state"] == "running"
            )
            sb.pause()
            updates.wait("it paused", lambda e: e[0] == "sandbox" and e[1]["state"] == "paused")
            sb.delete()
            updates.wait("its removal", lambda e: e == ("removed", {"id": sb.id}))
        assert all(foreign not in json.dumps(e) for e in updates.events)  # never another project's
    finally:
        c.delete_all(fake_cluster, other)
    assert updates.status == 200
    refused = httpx.get(
        fake_cluster.url + "/v1/sandbox-updates", headers={"Authorization": "Bearer space_bad"}, timeout=10
    )
    assert refused.status_code == 401


def _key_protocol(key: str) -> str:
    return "space-key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_pty_takes_the_key_as_a_subprotocol(fake_cluster: c.Cluster, project: c.Project) -> None:
    with project.sdk() as sp:
        sb = sp.sandboxes.create(limits=c.SMALL)
    url = fake_cluster.url.replace("http://", "ws://") + f"/v1/sandboxes/{sb.id}/pty?cmd=/bin/sh"
    with connect(url, subprotocols=["space-pty", _key_protocol(project.key)], open_timeout=10) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "space-pty"  # never the key's
        ws.send(b"echo sub-$((40 + 2))\n")
        seen = b""
        deadline = time.monotonic() + 15
        while b"sub-42" not in seen and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                data = ws.recv(timeout=1)
                seen += data if isinstance(data, bytes) else data.encode()
        assert b"sub-42" in seen, seen
    _, reader = project.new_key("read-only")
    for protocols, status in [
        (["space-pty", _key_protocol("space_wrong")], 401),
        (["space-pty", "space-key.%%%"], 401),
        (["space-pty"], 401),
        (["space-pty", _key_protocol(reader)], 403),
    ]:
        with pytest.raises(InvalidStatus) as refused:
            connect(url, subprotocols=protocols, open_timeout=10)  # type: ignore[arg-type]
        assert refused.value.response.status_code == status, protocols


def test_the_update_stream_ends_when_its_key_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream's own logic over a stand-in store (the served stream is tested above): it sends what
    changed and nothing else, then `ended` once the key no longer authenticates."""
    import asyncio
    import types

    from space.controlplane.api import overview

    rows: list[Any] = []
    valid = [True]
    store = types.SimpleNamespace(page_sandboxes=lambda project, query: types.SimpleNamespace(sandboxes=rows))
    reconciler = types.SimpleNamespace(changed=asyncio.Event())
    services: Any = types.SimpleNamespace(store=store, reconciler=reconciler)
    monkeypatch.setattr(overview, "sandbox_view", vars)
    monkeypatch.setattr(overview, "POLL_S", 0.01)
    monkeypatch.setattr(overview, "MIN_GAP_S", 0.0)
    monkeypatch.setattr(overview, "AUTH_RECHECK_S", 0.0)

    async def still_valid(_services: Any, _request: Any) -> bool:
        return valid[0]

    monkeypatch.setattr(overview, "_still_valid", still_valid)
    who: Any = types.SimpleNamespace(project_id="prj-x")

    async def run() -> list[bytes]:
        stream = overview._updates(services, who, None)  # type: ignore[arg-type]
        sent = [await anext(stream)]
        rows.append(types.SimpleNamespace(id="sb-1", state="running"))
        sent.append(await anext(stream))
        rows[0] = types.SimpleNamespace(id="sb-1", state="paused")
        sent.append(await anext(stream))
        rows.clear()
        sent.append(await anext(stream))
        valid[0] = False
        sent.append(await anext(stream))
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return sent

    sent = asyncio.run(run())
    assert sent == [
        b'event: snapshot\ndata: {"sandboxes":[]}\n\n',
        b'event: sandbox\ndata: {"id":"sb-1","state":"running"}\n\n',
        b'event: sandbox\ndata: {"id":"sb-1","state":"paused"}\n\n',
        b'event: removed\ndata: {"id":"sb-1"}\n\n',
        b'event: ended\ndata: {"reason":"the API key is no longer valid"}\n\n',
    ]
