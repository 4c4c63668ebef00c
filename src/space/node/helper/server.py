"""The root node helper: a unix-socket server over the fixed verb table of `verbs.py`.

Wire format: one JSON object per line each way. Request {"verb": str, "args": {...}}; the answer is any
number of {"progress": str} lines then exactly one {"ok": true, "result": {...}} or
{"ok": false, "error": {"code", "message", "details"}}.

Invariants:
- Only callers whose uid (SO_PEERCRED, checked by the kernel, not claimed by the caller) is root or the
  configured agent uid are served; others are disconnected with a permission_denied answer.
- A request line is at most MAX_REQUEST bytes; anything that is not a known verb with valid arguments is
  refused with invalid_argument before any side effect.
- Every failure is answered as a typed error; an unexpected exception is logged and answered as internal,
  and never takes the server down.
- Each verb has two kill points (crash injection, armed only by SPACE_FAILPOINTS; space.faults.failpoints):
  `helper.<verb>.before` once its arguments are valid and `helper.<verb>.after` once its handler returned,
  before the answer is sent (`helper_points()` lists them from the verb table).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import pwd
import signal
import socket
import socketserver
import struct
import sys
from typing import Any

from pydantic import ValidationError

from space.core import errors, tracing
from space.core.node_cgroups import parse_cgroup_parent
from space.core.settings import NodeSettings
from space.faults import failpoints
from space.node.filemodes import set_owner_only_umask
from space.node.helper.context import HelperContext
from space.node.helper.network import SandboxNetworks
from space.node.helper.runsc import Runsc
from space.node.helper.traced import traced_dispatch
from space.node.helper.verbs import VERBS
from space.node.layout import NodeLayout
from space.node.rlimits import raise_fd_limit
from space.rest.logs import configure_process_logging

log = logging.getLogger("space.node.helper")
MAX_REQUEST = 64 * 1024


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded it at connect time."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def validation_message(exc: ValidationError) -> tuple[str, list[str]]:
    fields = []
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        fields.append(where)
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts), fields


def helper_points() -> list[str]:
    """Both kill points of every verb of the verb table."""
    return sorted(failpoints.phased("helper", VERBS))


def dispatch(ctx: HelperContext, request: Any, send_progress: Any) -> dict[str, Any]:
    """Run one request; always returns the final answer object."""
    try:
        if not isinstance(request, dict) or set(request) - {"verb", "args"}:
            raise errors.InvalidArgument("a request is an object with 'verb' and 'args'")
        name = request.get("verb")
        verb = VERBS.get(name) if isinstance(name, str) else None
        if verb is None:
            raise errors.InvalidArgument(f"unknown verb {name!r}", verb=str(name)[:64])
        raw_args = request.get("args", {})
        if not isinstance(raw_args, dict):
            raise errors.InvalidArgument("'args' must be an object")
        try:
            params = verb.params.model_validate(raw_args)
        except ValidationError as exc:
            message, fields = validation_message(exc)
            raise errors.InvalidArgument(f"{verb.name}: {message}", fields=fields) from exc
        sandbox_id = getattr(params, "sandbox_id", None)
        failpoints.hit(f"helper.{verb.name}.before")
        if verb.sandbox_scoped and sandbox_id:
            with ctx.lock(sandbox_id):
                result = verb.handler(ctx, params, send_progress)
        else:
            result = verb.handler(ctx, params, send_progress)
        failpoints.hit(f"helper.{verb.name}.after")
        return {"ok": True, "result": result}
    except errors.SpaceError as exc:
        return {"ok": False, "error": exc.to_dict()}
    except Exception as exc:
        log.exception("verb failed unexpectedly")
        return {"ok": False, "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}


class _Handler(socketserver.StreamRequestHandler):
    server: HelperServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        _pid, uid, _gid = peer_credentials(sock)
        if uid not in self.server.allowed_uids:
            self._send(
                {
                    "ok": False,
                    "error": {
                        "code": "permission_denied",
                        "message": f"uid {uid} may not use the node helper",
                    },
                }
            )
            return
        while True:
            line = self.rfile.readline(MAX_REQUEST + 1)
            if not line:
                return
            if len(line) > MAX_REQUEST:
                self._send(
                    {
                        "ok": False,
                        "error": {"code": "too_large", "message": f"request exceeds {MAX_REQUEST} bytes"},
                    }
                )
                return
            try:
                request = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._send(
                    {
                        "ok": False,
                        "error": {"code": "invalid_argument", "message": f"request is not JSON: {exc}"},
                    }
                )
                continue
            progress = lambda text: self._send({"progress": text})  # noqa: E731
            # The request's trace context, if any, and the answer's spans (ADR 0072).
            answer = traced_dispatch(dispatch, self.server.context, request, progress)
            self._send(answer)

    def _send(self, obj: dict[str, Any]) -> None:
        try:
            self.wfile.write(json.dumps(obj).encode() + b"\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


class HelperServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, socket_path: str, context: HelperContext, allowed_uids: set[int]) -> None:
        self.context = context
        self.allowed_uids = allowed_uids
        tracing.configure("space-node-helper")  # spans of verbs the agent traces (ADR 0072)
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        super().__init__(socket_path, _Handler)
        os.chmod(socket_path, 0o600)
        os.chown(socket_path, context.owner_uid, -1)


def _resolve_uid(user: str) -> int:
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError as exc:
        raise SystemExit(f"no such user: {user}") from exc


def _cgroup_parent(value: str) -> str:
    try:
        return parse_cgroup_parent(value)  # the one validator of space.core.node_cgroups (ADR 0079)
    except errors.InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.message) from exc


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="SPACE node helper (root): the fixed verb table")
    parser.add_argument("--data-dir", required=True, type=pathlib.Path)
    parser.add_argument("--agent-user", default="0", help="user name or uid allowed to call the helper")
    parser.add_argument("--socket", type=pathlib.Path, default=None)
    parser.add_argument("--runsc", default="runsc")
    parser.add_argument("--platform", default="ptrace", choices=["systrap", "ptrace"])
    parser.add_argument(
        "--cgroup-parent", default="space", type=_cgroup_parent,
        help="cgroup under which sandboxes run (give each node on one machine its own)",
    )  # fmt: skip
    parser.add_argument(
        "--network", default=NodeSettings().network, choices=["none", "sandbox"],
        help="sandbox: each sandbox gets its own network namespace, reaching only the egress gateway",
    )  # fmt: skip
    parser.add_argument(
        "--favor-cgroup-moves", default=True, action=argparse.BooleanOptionalAction,
        help="ask the kernel for cheap cgroup moves (favordynmods) at node.prepare: faster runtime starts",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("space-node-helper must run as root", file=sys.stderr)
        return 2
    # Before anything is created: what the helper, runsc and the holders write is root's only (ADR 0022).
    set_owner_only_umask()
    try:  # text, or one JSON object per line (SPACE_LOG_FORMAT; ADR 0071)
        configure_process_logging("helper")
    except errors.InvalidArgument as exc:
        parser.error(exc.message)
    raise_fd_limit()  # one holder connection and descriptors per sandbox
    layout = NodeLayout(args.data_dir.resolve())
    layout.data_dir.mkdir(parents=True, exist_ok=True)
    owner = _resolve_uid(args.agent_user)
    context = HelperContext(
        layout=layout,
        runsc=Runsc(root=layout.runsc_root, binary=args.runsc, platform=args.platform, network=args.network),
        owner_uid=owner, cgroup_parent=args.cgroup_parent,
        network=SandboxNetworks(layout) if args.network == "sandbox" else None,
        favor_cgroup_moves=args.favor_cgroup_moves,
    )  # fmt: skip
    socket_path = str(args.socket or layout.helper_socket)
    server = HelperServer(socket_path, context, {0, owner})
    # SIGTERM unwinds through the `finally` below, so the socket file never outlives the helper.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"helper ready on {socket_path}", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        context.runtimes.close()
        server.server_close()
        if os.path.exists(socket_path):
            os.unlink(socket_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
