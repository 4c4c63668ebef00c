"""`space files ls` with --depth and --long: the request it sends and the table it prints."""

from __future__ import annotations

import httpx

from tests.support.sdk_server import FakeServer, invoke


def test_files_ls_long_and_deep(server: FakeServer) -> None:
    common = {"target": None}
    entries = [
        {"name": "d", "path": "/work/d", "type": "dir", "size": 0, "mode": 0o755, **common,
         "permissions": "drwxr-xr-x", "owner": "user", "group": "user", "uid": 1000, "gid": 1000},
        {"name": "f", "path": "/work/d/f", "type": "file", "size": 3, "mode": 0o600, **common,
         "permissions": "-rw-------", "owner": None, "group": None, "uid": 54321, "gid": 54322},
    ]  # fmt: skip
    answer = {"entries": entries, "truncated": True}
    server.on("GET", "/v1/sandboxes/sb-1/files/list", httpx.Response(200, json=answer))
    result = invoke("files", "ls", "-l", "--depth", "2", "sb-1", "/work")
    assert result.exit_code == 0, result.output
    assert server.last().url.params["depth"] == "2"
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["dir", "0755", "drwxr-xr-x", "user", "user", "0", "d"]
    assert lines[2].split() == ["file", "0600", "-rw-------", "54321", "54322", "3", "d/f"]
    assert "truncated" in result.stderr
    assert invoke("files", "ls", "--depth", "17", "sb-1", "/work").exit_code != 0
