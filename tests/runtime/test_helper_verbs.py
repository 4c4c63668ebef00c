"""The root helper refuses everything outside its verb table before any side effect (no root needed:
refusals happen in validation, before a verb touches the system)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import threading
from collections.abc import Iterator

import pytest

from space.core.ids import new_sandbox_id, new_snapshot_id
from space.node.helper.context import HelperContext
from space.node.helper.server import HelperServer, dispatch
from space.node.helper.verbs import VERBS
from tests.support import helper_context

ctx = helper_context.ctx  # a helper context without root


def refused(answer: dict[str, object], code: str = "invalid_argument") -> str:
    assert answer["ok"] is False, answer
    error = answer["error"]
    assert isinstance(error, dict)
    assert error["code"] == code, error
    return str(error["message"])


def test_unknown_verb(ctx: HelperContext) -> None:
    message = refused(dispatch(ctx, {"verb": "shell.run", "args": {"cmd": "id"}}, print))
    assert "unknown verb" in message


@pytest.mark.parametrize(
    "bad_id",
    [
        "sb-../../etc",
        "sb-" + "a" * 26 + "\n",
        "../sb-x",
        "",
        "SB-" + "a" * 26,
        "sb-" + "a" * 25,
        42,
        None,
        "sb-" + "a" * 25 + "b",
        "sb-" + "a" * 26 + "/x",
    ],
)
def test_malformed_sandbox_ids_are_refused(ctx: HelperContext, bad_id: object) -> None:
    message = refused(dispatch(ctx, {"verb": "sandbox.destroy", "args": {"sandbox_id": bad_id}}, print))
    assert "sandbox_id" in message


def test_extra_and_missing_arguments(ctx: HelperContext) -> None:
    sid = new_sandbox_id()
    refused(dispatch(ctx, {"verb": "sandbox.stop", "args": {"sandbox_id": sid, "force": True}}, print))
    refused(dispatch(ctx, {"verb": "sandbox.checkpoint", "args": {"sandbox_id": sid}}, print))
    refused(dispatch(ctx, {"verb": "sandbox.stop", "args": "sb-x"}, print))
    refused(dispatch(ctx, ["sandbox.stop"], print))
    refused(dispatch(ctx, {"verb": "sandbox.stop", "args": {}, "sudo": True}, print))


def test_discard_takes_only_a_valid_sandbox_id_and_touches_nothing_else(ctx: HelperContext) -> None:
    """sandbox.discard (a rollback's stop, ADR 0077) kills by pids it derives itself from the sandbox's own
    records: nothing to name but the id, which is validated like every other."""
    for bad in ("sb-../../etc", "../sb-x", "sb-" + "a" * 26 + "/x", "", 42, None):
        assert "sandbox_id" in refused(
            dispatch(ctx, {"verb": "sandbox.discard", "args": {"sandbox_id": bad}}, print)
        )
    sid = new_sandbox_id()
    for extra in ({"pid": 1}, {"signal": "KILL"}, {"container": "x"}):
        refused(dispatch(ctx, {"verb": "sandbox.discard", "args": {"sandbox_id": sid, **extra}}, print))
    # An id this node holds nothing of: nothing runs, nothing to kill, nothing made.
    answer = dispatch(ctx, {"verb": "sandbox.discard", "args": {"sandbox_id": sid}}, print)
    assert answer == {"ok": True, "result": {"status": "stopped"}}, answer
    assert not ctx.layout.run_dir(sid).exists() and not ctx.layout.bundle(sid).exists()


def test_limits_are_validated(ctx: HelperContext) -> None:
    args = {
        "sandbox_id": new_sandbox_id(),
        "limits": {"cpus": 1.0, "memory_mb": 1, "pids": 100, "disk_mb": 100},
    }
    assert "memory_mb" in refused(dispatch(ctx, {"verb": "sandbox.create", "args": args}, print))
    args["limits"] = {"cpus": True, "memory_mb": 512, "pids": 100, "disk_mb": 100}
    assert "cpus" in refused(dispatch(ctx, {"verb": "sandbox.create", "args": args}, print))


def test_env_cannot_smuggle_nul_or_bad_names(ctx: HelperContext) -> None:
    for env in ({"A B": "x"}, {"X": "a\x00b"}, {"1X": "y"}):
        args = {"sandbox_id": new_sandbox_id(), "env": env}
        refused(dispatch(ctx, {"verb": "sandbox.create", "args": args}, print))
        refused(dispatch(ctx, {"verb": "sandbox.configure", "args": args}, print))


def test_configure_needs_an_existing_sandbox_and_bounded_env(ctx: HelperContext) -> None:
    """sandbox.configure (a pooled sandbox bound to its user, ADR 0047) rewrites an existing bundle only."""
    sid = new_sandbox_id()
    refused(dispatch(ctx, {"verb": "sandbox.configure", "args": {"sandbox_id": sid, "env": {}}}, print),
            "not_found")  # fmt: skip
    huge = {f"V{i}": "x" for i in range(257)}
    refused(dispatch(ctx, {"verb": "sandbox.configure", "args": {"sandbox_id": sid, "env": huge}}, print))
    refused(dispatch(ctx, {"verb": "sandbox.configure", "args": {"sandbox_id": sid, "template": "x"}}, print))
    assert not ctx.layout.bundle(sid).exists()


def test_path_outside_the_data_directory_is_refused(ctx: HelperContext, tmp_path: pathlib.Path) -> None:
    outside = tmp_path / "outside.tar"
    outside.write_bytes(b"")
    for path in (
        "/etc/passwd",
        str(outside),
        str(ctx.layout.data_dir / ".." / "outside.tar"),
        "relative.tar",
    ):
        message = refused(
            dispatch(ctx, {"verb": "template.receive", "args": {"name": "evil", "stream": path}}, print)
        )
        assert "path" in message or "absolute" in message
    link = ctx.layout.data_dir / "link.tar"
    link.symlink_to(outside)
    refused(dispatch(ctx, {"verb": "template.receive", "args": {"name": "evil", "stream": str(link)}}, print))


def test_template_names_are_validated(ctx: HelperContext) -> None:
    for name in ("../x", "Python", "", "a" * 70, "py thon"):
        refused(dispatch(ctx, {"verb": "template.ensure", "args": {"name": name}}, print))


def test_every_verb_forbids_unknown_fields() -> None:
    for verb in VERBS.values():
        assert verb.params.model_config.get("extra") == "forbid", verb.name


def test_snapshot_ids_are_validated(ctx: HelperContext) -> None:
    args = {"sandbox_id": new_sandbox_id(), "snapshot_id": "snap-../../x"}
    assert "snapshot_id" in refused(dispatch(ctx, {"verb": "snapshot.delete", "args": args}, print))
    args["snapshot_id"] = new_snapshot_id()
    # valid ids pass validation and then fail on the missing snapshot, with a typed not_found
    refused(dispatch(ctx, {"verb": "snapshot.delete", "args": args}, print), code="not_found")


@pytest.fixture
def server(ctx: HelperContext, tmp_path: pathlib.Path) -> Iterator[str]:
    path = str(tmp_path / "h.sock")
    srv = HelperServer(path, ctx, {os.getuid()})
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield path
    srv.shutdown()
    srv.server_close()


def ask(path: str, payload: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(payload)
        data = sock.makefile("rb").readline()
    return json.loads(data)


def test_server_answers_garbage_and_huge_requests_with_typed_errors(server: str) -> None:
    refused(ask(server, b"not json\n"))
    refused(ask(server, b"x" * (70 * 1024) + b"\n"), code="too_large")
    refused(ask(server, json.dumps({"verb": "nope"}).encode() + b"\n"))


def test_server_refuses_a_caller_with_another_uid(ctx: HelperContext, tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "h2.sock")
    srv = HelperServer(path, ctx, {os.getuid() + 12345})
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        refused(
            ask(path, json.dumps({"verb": "sandbox.list", "args": {}}).encode() + b"\n"),
            code="permission_denied",
        )
    finally:
        srv.shutdown()
        srv.server_close()
