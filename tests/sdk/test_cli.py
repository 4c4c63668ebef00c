"""`space` CLI through typer's CliRunner against a fake API: output, --json, exit codes."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer

from space.cli import admin
from space.cli import main as cli_main
from tests.support.sdk_server import (
    FakeServer,
    b64,
    error_response,
    invoke,
    ndjson,
    runner,
    sandbox_json,
)

# ---- sandbox -----------------------------------------------------------------------------------------


def test_sandbox_create_prints_the_id(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-new")))
    result = invoke(
        "sandbox", "create", "--env", "A=1", "--env", "B=x=y", "--allow", "pkg.test", "--credential", "gh"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "sb-new\n"
    assert server.body() == {
        "template": "python",
        "env": {"A": "1", "B": "x=y"},
        "allow": ["pkg.test"],
        "credentials": ["gh"],
        "wait": True,
    }


def test_sandbox_create_json_and_limits(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes", httpx.Response(201, json=sandbox_json("sb-new")))
    result = invoke("sandbox", "create", "--template", "node", "--cpus", "2", "--memory-mb", "1024", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["id"] == "sb-new"
    assert server.body()["limits"] == {"cpus": 2.0, "memory_mb": 1024}
    assert server.body()["template"] == "node"


def test_sandbox_create_bad_env_is_a_usage_error(server: FakeServer) -> None:
    result = invoke("sandbox", "create", "--env", "NOEQUALS")
    assert result.exit_code == 2
    assert not server.requests


def test_global_url_and_key_options(server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes", httpx.Response(200, json={"sandboxes": []}))
    result = invoke("--url", "http://other:1", "--api-key", "sk-x", "sandbox", "list", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == []
    assert server.made == [("http://other:1", "sk-x")]  # type: ignore[attr-defined]


def test_sandbox_list(server: FakeServer) -> None:
    server.on(
        "GET",
        "/v1/sandboxes",
        httpx.Response(200, json={"sandboxes": [sandbox_json("sb-a"), sandbox_json("sb-b", state="paused")]}),
    )
    result = invoke("sandbox", "list")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATE", "TEMPLATE", "NODE", "CREATED", "EXPIRES"]
    assert lines[1].split()[:2] == ["sb-a", "running"] and lines[2].split()[:2] == ["sb-b", "paused"]
    as_json = invoke("sandbox", "list", "--json")
    assert [s["id"] for s in json.loads(as_json.stdout)] == ["sb-a", "sb-b"]


def test_sandbox_get(server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes/sb-1", httpx.Response(200, json=sandbox_json()))
    result = invoke("sandbox", "get", "sb-1")
    assert result.exit_code == 0 and "state" in result.stdout and "running" in result.stdout
    assert json.loads(invoke("sandbox", "get", "sb-1", "--json").stdout)["id"] == "sb-1"


def test_sandbox_get_not_found_exits_3(server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes/sb-x", error_response(404, "not_found", "no sandbox sb-x"))
    result = invoke("sandbox", "get", "sb-x", "--json")
    assert result.exit_code == 3
    assert result.stdout == ""
    assert result.stderr == "error: not_found: no sandbox sb-x\n"


@pytest.mark.parametrize("action", ["pause", "resume", "stop", "start", "suspend", "restore"])
def test_sandbox_lifecycle(server: FakeServer, action: str) -> None:
    server.on(
        "POST", f"/v1/sandboxes/sb-1/{action}", httpx.Response(200, json=sandbox_json(state="x" + action))
    )
    result = invoke("sandbox", action, "sb-1")
    assert result.exit_code == 0
    assert result.stdout == f"sb-1 x{action}\n"
    assert server.last().url.params["wait"] == "true"


def test_sandbox_delete(server: FakeServer) -> None:
    server.on("DELETE", "/v1/sandboxes/sb-1", httpx.Response(202, json=sandbox_json(state="deleting")))
    result = invoke("sandbox", "delete", "sb-1")
    assert result.exit_code == 0 and result.stdout == "sb-1 deleting\n"


def test_invalid_state_exits_4(server: FakeServer) -> None:
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/resume",
        error_response(409, "invalid_state", "is running", state="running"),
    )
    result = invoke("sandbox", "resume", "sb-1")
    assert result.exit_code == 4
    assert result.stderr == "error: invalid_state: is running\n"


@pytest.mark.parametrize(
    ("status", "code", "exit_code"),
    [
        (401, "unauthenticated", 5),
        (403, "permission_denied", 5),
        (500, "internal", 1),
        (400, "invalid_argument", 1),
    ],
)
def test_api_error_exit_codes(server: FakeServer, status: int, code: str, exit_code: int) -> None:
    server.on("GET", "/v1/sandboxes", error_response(status, code, "bad"))
    result = invoke("sandbox", "list")
    assert result.exit_code == exit_code
    assert result.stderr == f"error: {code}: bad\n"


def test_unreachable_server_exits_6(server: FakeServer) -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    server.on("GET", "/v1/sandboxes", refused)
    result = invoke("sandbox", "list")
    assert result.exit_code == 6
    assert result.stderr.startswith("error: transport_error: ")


def test_no_configuration_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPACE_URL", raising=False)
    monkeypatch.delenv("SPACE_API_KEY", raising=False)
    monkeypatch.setenv("SPACE_CONFIG", str(tmp_path / "none.json"))
    result = invoke("sandbox", "list")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: configuration_error: no server configured")


def test_fork_prints_child_ids(server: FakeServer) -> None:
    server.on(
        "POST", "/v1/sandboxes/sb-1/fork", httpx.Response(201, json={"sandboxes": [sandbox_json("sb-c")]})
    )
    result = invoke("sandbox", "fork", "sb-1")
    assert result.exit_code == 0 and result.stdout == "sb-c\n"
    assert server.body() == {"count": 1}
    assert json.loads(invoke("sandbox", "fork", "sb-1", "--json").stdout)["id"] == "sb-c"
    server.on(
        "POST",
        "/v1/sandboxes/sb-1/fork",
        httpx.Response(201, json={"sandboxes": [sandbox_json("sb-c1"), sandbox_json("sb-c2")]}),
    )
    assert invoke("sandbox", "fork", "sb-1", "--count", "2").stdout == "sb-c1\nsb-c2\n"


def test_rollback(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes/sb-1/rollback", httpx.Response(200, json=sandbox_json()))
    result = invoke("sandbox", "rollback", "sb-1", "snap-1")
    assert result.exit_code == 0 and result.stdout == "sb-1 running\n"
    assert server.body() == {"snapshot_id": "snap-1"}


# ---- snapshot ----------------------------------------------------------------------------------------


def test_snapshot_create_and_list(server: FakeServer) -> None:
    snap = {"id": "snap-1", "sandbox_id": "sb-1", "kind": "full", "created_at": "t", "size_bytes": 5}
    server.on("POST", "/v1/sandboxes/sb-1/snapshots", httpx.Response(201, json=snap))
    server.on("GET", "/v1/sandboxes/sb-1/snapshots", httpx.Response(200, json={"snapshots": [snap]}))
    result = invoke("snapshot", "create", "sb-1", "--full")
    assert result.exit_code == 0 and result.stdout == "snap-1\n"
    assert server.body() == {"full": True}
    assert json.loads(invoke("snapshot", "create", "sb-1", "--json").stdout)["kind"] == "full"
    assert server.body() == {"full": False}
    listed = invoke("snapshot", "list", "sb-1")
    # ID, KIND, CREATED, EXCLUSIVE (unknown here), SIZE, LOCATION (none given)
    assert listed.stdout.splitlines()[1].split() == ["snap-1", "full", "t", "-", "5", "B", "-"]
    assert json.loads(invoke("snapshot", "list", "sb-1", "--json").stdout)[0]["id"] == "snap-1"


# ---- exec --------------------------------------------------------------------------------------------


def exec_stream_answer(exit_code: int | None = 0, **exit_fields: Any) -> httpx.Response:
    return ndjson(
        {"type": "started", "process_id": "p-1"},
        {"type": "stdout", "data_b64": b64(b"out\n")},
        {"type": "stderr", "data_b64": b64(b"err\n")},
        {"type": "exit", "exit_code": exit_code, **exit_fields},
    )


def test_exec_streams_and_passes_the_exit_code_through(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes/sb-1/exec", exec_stream_answer(7))
    result = invoke("exec", "sb-1", "--", "sh", "-c", "exit 7")
    assert result.exit_code == 7
    assert result.stdout == "out\n" and result.stderr == "err\n"
    assert server.body() == {"argv": ["sh", "-c", "exit 7"], "stream": True}


def test_exec_without_double_dash_and_options(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes/sb-1/exec", exec_stream_answer(0))
    result = invoke("exec", "--env", "A=1", "--cwd", "/work", "sb-1", "ls", "-la")
    assert result.exit_code == 0
    assert server.body() == {"argv": ["ls", "-la"], "env": {"A": "1"}, "cwd": "/work", "stream": True}


def test_exec_stdin(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes/sb-1/exec", exec_stream_answer(0))
    result = invoke("exec", "--stdin", "sb-1", "--", "cat", input=b"hello")
    assert result.exit_code == 0
    assert server.body()["stdin_b64"] == b64(b"hello")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"signal": "SIGKILL"}, 137), ({"signal": 15}, 143), ({"signal": 9, "timed_out": True}, 124)],
)
def test_exec_signal_and_timeout_exit_codes(
    server: FakeServer, fields: dict[str, Any], expected: int
) -> None:
    server.on("POST", "/v1/sandboxes/sb-1/exec", exec_stream_answer(None, **fields))
    assert invoke("exec", "sb-1", "--", "sleep", "9").exit_code == expected


def test_exec_errors(server: FakeServer) -> None:
    server.on("POST", "/v1/sandboxes/sb-1/exec", error_response(404, "not_found", "no sandbox"))
    result = invoke("exec", "sb-1", "--", "true")
    assert result.exit_code == 3 and result.stderr == "error: not_found: no sandbox\n"
    assert invoke("exec", "sb-1").exit_code == 2
    assert invoke("exec", "sb-1", "--").exit_code == 2


# ---- files -------------------------------------------------------------------------------------------


def test_files_write_from_stdin(server: FakeServer) -> None:
    server.on("PUT", "/v1/sandboxes/sb-1/files", lambda r: httpx.Response(200, json={"size": len(r.content)}))
    result = invoke("files", "write", "sb-1", "/work/a.bin", "--mode", "0600", input=b"\x00\x01data")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    request = server.last()
    assert request.content == b"\x00\x01data"
    assert dict(request.url.params) == {"path": "/work/a.bin", "mode": "384"}


def test_files_read_to_stdout(server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes/sb-1/files", httpx.Response(200, content=b"\xffbinary\n"))
    result = invoke("files", "read", "sb-1", "/work/a.bin")
    assert result.exit_code == 0
    assert result.stdout_bytes == b"\xffbinary\n"


def test_files_read_missing_exits_3(server: FakeServer) -> None:
    server.on("GET", "/v1/sandboxes/sb-1/files", error_response(404, "not_found", "no such file"))
    result = invoke("files", "read", "sb-1", "/nope")
    assert result.exit_code == 3 and result.stdout_bytes == b""


def test_files_ls(server: FakeServer) -> None:
    entries = [
        {"name": "a.txt", "type": "file", "size": 4, "mode": 0o644, "target": None},
        {"name": "l", "type": "symlink", "size": 5, "mode": 0o777, "target": "a.txt"},
    ]
    server.on("GET", "/v1/sandboxes/sb-1/files/list", httpx.Response(200, json={"entries": entries}))
    result = invoke("files", "ls", "sb-1", "/work")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["file", "0644", "4", "a.txt"]
    assert lines[2].split() == ["symlink", "0777", "5", "l", "->", "a.txt"]
    assert json.loads(invoke("files", "ls", "sb-1", "/work", "--json").stdout) == entries


# ---- projects, keys, credentials ---------------------------------------------------------------------


def test_project_and_key_create(server: FakeServer) -> None:
    server.on(
        "POST", "/v1/projects", httpx.Response(201, json={"id": "prj-9", "name": "team", "org_id": "o"})
    )
    server.on(
        "POST", "/v1/keys", httpx.Response(201, json={"id": "key-1", "key": "sk-secret", "role": "read-only"})
    )
    result = invoke("project", "create", "team")
    assert result.exit_code == 0 and result.stdout == "prj-9\n"
    result = invoke("key", "create", "--project", "team", "--role", "read-only")
    assert result.exit_code == 0 and result.stdout == "sk-secret\n"
    assert server.body() == {"project": "team", "role": "read-only"}
    assert invoke("key", "create", "--project", "team", "--e2b").exit_code == 0
    assert server.body() == {"project": "team", "role": "member", "shape": "e2b"}
    assert invoke("key", "create", "--project", "team", "--role", "god").exit_code == 2
    assert invoke("key", "create").exit_code == 2


def test_credential_set(server: FakeServer) -> None:
    answer = {"id": "cred-1", "name": "gh", "placeholder": "space-cred-gh-0123456789abcdef"}
    server.on("PUT", "/v1/credentials/gh", httpx.Response(200, json=answer))
    result = invoke(
        "credential", "set", "gh", "--value", "tok", "--host", "code.test",
        "--header", "Authorization: Bearer {value}", "--project", "team",
    )  # fmt: skip
    assert result.exit_code == 0 and result.stdout == "gh space-cred-gh-0123456789abcdef\n"
    assert server.body() == {
        "value": "tok",
        "hosts": ["code.test"],
        "header": "Authorization: Bearer {value}",
        "project": "team",
    }
    result = invoke("credential", "set", "gh", "--value", "-", "--host", "h", input="from-stdin\n")
    assert result.exit_code == 0 and server.body()["value"] == "from-stdin"
    result = invoke(
        "credential", "set", "gh", "--rate-per-minute", "30", "--expires-at", "2030-01-01T00:00:00Z"
    )
    assert result.exit_code == 0 and server.body() == {
        "rate_per_minute": 30,
        "expires_at": "2030-01-01T00:00:00Z",
    }


def test_credential_list_delete_audit(server: FakeServer) -> None:
    item = {"name": "gh", "scope": "project", "hosts": ["code.test"], "method": "bearer", "version": 2}
    listed = {"credentials": [item | {"expires_at": None, "placeholder": "space-cred-gh-x"}]}
    server.on("GET", "/v1/credentials", httpx.Response(200, json=listed))
    result = invoke("credential", "list")
    assert result.exit_code == 0 and "space-cred-gh-x" in result.stdout and "code.test" in result.stdout
    server.on("DELETE", "/v1/credentials/gh", httpx.Response(200, json={"deleted": True}))
    assert invoke("credential", "delete", "gh").exit_code == 0
    server.on(
        "GET", "/v1/credentials/gh/audit", httpx.Response(200, json={"entries": [{"action": "rotate"}]})
    )
    result = invoke("credential", "audit", "gh", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == [{"action": "rotate"}]


def test_sandbox_egress_shows_and_changes_the_policy(server: FakeServer) -> None:
    policy = {"allow": ["pkg.test"], "deny": [], "credentials": [], "version": 2, "applied": True}
    server.on("PUT", "/v1/sandboxes/sb-1/egress", httpx.Response(200, json=policy))
    result = invoke("sandbox", "egress", "sb-1", "--allow", "pkg.test", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["version"] == 2
    assert server.body() == {"allow": ["pkg.test"]}
    server.on("GET", "/v1/sandboxes/sb-1/egress", httpx.Response(200, json=policy))
    result = invoke("sandbox", "egress", "sb-1")
    assert result.exit_code == 0 and "pkg.test" in result.stdout


# ---- bench, up/down ----------------------------------------------------------------------------------


def test_bench_missing_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin, "find_bench_module", lambda: None)
    result = invoke("bench", "--quick")
    assert result.exit_code == 2 and "api_bench" in result.stderr


def test_bench_runs_the_module_with_the_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = tmp_path / "bench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    record = tmp_path / "args.json"
    (package / "api_bench.py").write_text(
        f"import json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\nraise SystemExit(5)\n"
    )
    monkeypatch.chdir(tmp_path)
    result = invoke("bench", "--quick", "--json", "--rate", "2")
    assert result.exit_code == 5
    # The template always (its default named), then the flags given and the options set.
    assert json.loads(record.read_text()) == ["--template", "python", "--quick", "--json", "--rate", "2.0"]


def test_up_and_down_registered_when_space_cli_up_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake = types.ModuleType("space.cli.up")

    def up(detach: bool = False) -> None:
        calls.append(f"up detach={detach}")

    def down() -> None:
        calls.append("down")

    fake.up = up  # type: ignore[attr-defined]
    fake.down = down  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "space.cli.up", fake)
    target = typer.Typer()
    target.command("noop")(lambda: None)
    cli_main._register_up(target)
    assert runner.invoke(target, ["up", "--detach"]).exit_code == 0
    assert runner.invoke(target, ["down"]).exit_code == 0
    assert calls == ["up detach=True", "down"]


def test_up_absent_without_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli_main, "importlib", types.SimpleNamespace(import_module=missing))
    target = typer.Typer()
    cli_main._register_up(target)
    assert target.registered_commands == []


def test_help_lists_the_contract_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("sandbox", "snapshot", "exec", "files", "project", "key", "credential", "bench"):
        assert name in result.stdout
    for group, commands in {
        "sandbox": ["create", "list", "get", "pause", "resume", "stop", "start", "suspend", "restore",
                    "delete", "fork", "rollback"],
        "snapshot": ["create", "list"],
        "files": ["write", "read", "ls"],
        "project": ["create"],
        "key": ["create"],
        "credential": ["set"],
    }.items():  # fmt: skip
        text = invoke(group, "--help").stdout
        for command in commands:
            assert command in text, (group, command)
