"""Plain result objects and the request bodies shared by the sync and async clients (no I/O here).

Invariants:
- Results keep the server's raw dict in `.data`, so fields the SDK does not know yet are never lost.
- Bytes on the wire travel as base64 (`*_b64`); results expose raw bytes and utf-8 text decoded with
  replacement, never raising on undecodable output.
"""

from __future__ import annotations

import base64
import signal as _signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from space.core.errors import InvalidArgument, SpaceError, error_from_dict
from space.protocol.commands import command_params

__all__ = [
    "ApiKey",
    "Command",
    "Credential",
    "ExecResult",
    "MetricSample",
    "ProcessEvent",
    "Project",
    "Record",
    "Snapshot",
]

Command = str | Sequence[str]


class Record(Mapping[str, Any]):
    """A server object: read-only mapping over its JSON, with attribute access (`rec.id`, `rec["id"]`)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data: dict[str, Any] = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "data":
            raise AttributeError(name)
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    @property
    def id(self) -> str:
        return str(self.data.get("id", ""))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.data!r})"


class Project(Record):
    @property
    def name(self) -> str:
        return str(self.data.get("name", ""))


class ApiKey(Record):
    @property
    def key(self) -> str | None:
        return _opt_str(self.data.get("key"))


class Credential(Record):
    pass


class Snapshot(Record):
    @property
    def name(self) -> str | None:
        """The name it was given (full snapshots only; None: none)."""
        return _opt_str(self.data.get("name"))

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", ""))

    @property
    def exclusive_bytes(self) -> int | None:
        """Space on the node's disk only this snapshot holds (None when unknown)."""
        value = self.data.get("exclusive_bytes")
        return None if value is None else int(value)

    @property
    def locations(self) -> list[str]:
        """Where copies are: "node:<id>" and/or "objectstore"."""
        return [str(item) for item in self.data.get("locations") or []]

    @property
    def sandbox_id(self) -> str:
        return str(self.data.get("sandbox_id", ""))


class SandboxEvent(Record):
    """Something that happened to a sandbox beyond its state (a crash and its reason, a recovery, a lost
    node): `id` (int, increasing; pass the last one as `after` to read on), `at`, `kind`, `message`,
    `detail`."""

    @property
    def number(self) -> int:
        """The event's id as a number (the cursor for `events(after=...)`)."""
        return int(self.data.get("id", 0))

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", ""))

    @property
    def message(self) -> str:
        return str(self.data.get("message", ""))

    @property
    def detail(self) -> dict[str, Any]:
        return dict(self.data.get("detail") or {})


class MetricSample(Record):
    """One sample of a sandbox's metrics history: `timestamp` (Unix seconds), `cpu_count` (its CPU limit),
    `cpu_used_pct` (of that limit, since the previous sample), `mem_used_bytes` / `mem_total_bytes` (its
    limit), `mem_cache_bytes`, `disk_used_bytes` / `disk_total_bytes` (its storage budget); a byte count the
    node cannot tell is None."""

    @property
    def at(self) -> datetime:
        """`timestamp` as an aware UTC datetime."""
        return datetime.fromtimestamp(float(self.data.get("timestamp", 0.0)), tz=UTC)

    @property
    def cpu_used_pct(self) -> float:
        return float(self.data.get("cpu_used_pct", 0.0))

    @property
    def mem_used_bytes(self) -> int:
        return int(self.data.get("mem_used_bytes", 0))


def metrics_params(
    start: float | datetime | None, end: float | datetime | None, limit: int | None
) -> dict[str, str | int | float | None]:
    """The query of GET /v1/sandboxes/{id}/metrics: a datetime goes as its Unix time."""

    def seconds(value: float | datetime | None) -> float | None:
        return value.timestamp() if isinstance(value, datetime) else value

    return {"start": seconds(start), "end": seconds(end), "limit": limit}


def _b64(value: Any) -> bytes:
    if not value:
        return b""
    return base64.b64decode(str(value))


@dataclass(frozen=True)
class ExecResult:
    """What a command did: exit code (None if a signal ended it), output as bytes and as text.

    A non-streamed exec keeps a bounded amount of each stream (1 MiB unless the request asked for more, up
    to the node's maximum); `stdout_truncated` / `stderr_truncated` say that output was cut there."""

    exit_code: int | None
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    process_id: str | None = None
    signal: int | str | None = None
    timed_out: bool = False
    data: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ExecResult:
        def channel(name: str) -> bytes:
            if data.get(f"{name}_b64") is not None:
                return _b64(data[f"{name}_b64"])
            text = data.get(name)
            return str(text).encode("utf-8") if text else b""

        return cls(
            exit_code=_opt_int(data.get("exit_code")),
            stdout_bytes=channel("stdout"),
            stderr_bytes=channel("stderr"),
            process_id=_opt_str(data.get("process_id")),
            signal=data.get("signal"),
            timed_out=bool(data.get("timed_out", False)),
            data=dict(data),
            stdout_truncated=bool(data.get("stdout_truncated", False)),
            stderr_truncated=bool(data.get("stderr_truncated", False)),
        )


@dataclass(frozen=True)
class ProcessEvent:
    """One line of an exec/attach stream: started, attached, stdout, stderr or exit."""

    type: str
    data: bytes = b""
    process_id: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: int | str | None = None
    timed_out: bool = False
    offset: int | None = None
    truncated: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_wire(cls, event: Mapping[str, Any]) -> ProcessEvent:
        return cls(
            type=str(event.get("type", "")),
            data=_b64(event.get("data_b64")),
            process_id=_opt_str(event.get("process_id")),
            pid=_opt_int(event.get("pid")),
            exit_code=_opt_int(event.get("exit_code")),
            signal=event.get("signal"),
            timed_out=bool(event.get("timed_out", False)),
            offset=_opt_int(event.get("offset")),
            truncated=bool(event.get("truncated", False)),
            raw=dict(event),
        )


class OutputCollector:
    """Gathers the stdout/stderr events of one command into the ExecResult of its exit event."""

    def __init__(self) -> None:
        self.stdout: list[bytes] = []
        self.stderr: list[bytes] = []

    def keep(self, event: ProcessEvent) -> None:
        """Keep the data of a stdout or stderr event (any other event is ignored)."""
        if event.type == "stdout":
            self.stdout.append(event.data)
        elif event.type == "stderr":
            self.stderr.append(event.data)

    def result(self, exit_event: ProcessEvent, process_id: str | None) -> ExecResult:
        return ExecResult(
            exit_code=exit_event.exit_code,
            stdout_bytes=b"".join(self.stdout),
            stderr_bytes=b"".join(self.stderr),
            process_id=process_id,
            signal=exit_event.signal,
            timed_out=exit_event.timed_out,
            data=exit_event.raw,
        )


def _opt_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


# ---- request bodies (shared by Space and AsyncSpace) -------------------------------------------------


def seg(value: str | int) -> str:
    """One URL path segment (an id): quoted so it can never add path components, and never a dot segment
    (an HTTP client resolves "." and ".." in a path: /v1/sandboxes/.. would be /v1)."""
    text = str(value)
    if not text:
        raise InvalidArgument("an id must not be empty")
    if text in {".", ".."}:
        raise InvalidArgument(f"{text!r} is not an id")
    return quote(text, safe="")


def _command(cmd: Command) -> str | list[str]:
    if isinstance(cmd, str):
        if not cmd:
            raise InvalidArgument("the command must not be empty")
        return cmd
    if isinstance(cmd, bytes | bytearray):
        raise InvalidArgument("the command must be a str (shell) or a list of str (argv), not bytes")
    argv = [str(arg) for arg in cmd]
    if not argv:
        raise InvalidArgument("argv must not be empty")
    return argv


def exec_body(
    cmd: Command,
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    timeout: float | None,
    stdin: bytes | None,
    stream: bool,
    max_output_bytes: int | None = None,
) -> dict[str, Any]:
    body = command_params(_command(cmd), env, cwd, user, timeout)
    if max_output_bytes is not None:
        body["max_output_bytes"] = max_output_bytes
    if stdin is not None:
        body["stdin_b64"] = base64.b64encode(stdin).decode("ascii")
    body["stream"] = stream
    return body


def process_body(
    cmd: Command,
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    timeout: float | None,
    tag: str | None,
    pty: tuple[int, int] | None,
) -> dict[str, Any]:
    body = command_params(_command(cmd), env, cwd, user, timeout)
    if tag is not None:
        body["tag"] = tag
    if pty is not None:
        body["pty"] = {"rows": pty[0], "cols": pty[1]}
    return body


def create_body(
    *,
    template: str,
    env: Mapping[str, str] | None,
    limits: Mapping[str, Any] | None,
    idle_timeout_s: int | None,
    ttl_s: int | None,
    allow: Sequence[str] | None,
    credentials: Sequence[str] | None,
    wait: bool,
    deny: Sequence[str] | None = None,
    snapshot_policy: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    on_timeout: str | None = None,
    from_snapshot: str | None = None,
    isolation: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"from_snapshot": from_snapshot} if from_snapshot else {"template": template}
    body["env"] = dict(env or {})
    if limits is not None:
        body["limits"] = dict(limits)
    if allow:
        body["allow"] = list(allow)
    if credentials:
        body["credentials"] = list(credentials)
    if deny:
        body["egress"] = {"deny": list(deny)}
    if snapshot_policy is not None:
        body["snapshot_policy"] = dict(snapshot_policy)
    if metadata is not None:
        body["metadata"] = dict(metadata)
    optional = dict(idle_timeout_s=idle_timeout_s, ttl_s=ttl_s, on_timeout=on_timeout, isolation=isolation)
    body.update({name: value for name, value in optional.items() if value is not None})
    body["wait"] = wait
    return body


def list_params(
    *,
    state: str | Sequence[str] | None,
    template: str | None,
    metadata: Mapping[str, str] | None,
    order: str,
    limit: int | None,
    page_token: str | None,
    created_after: datetime | str | None = None,
) -> dict[str, str | int | list[str] | None]:
    """The query of GET /v1/sandboxes: `state` and `metadata` (as key=value) repeated; `created_after` an
    aware datetime (or its ISO 8601 text), inclusive."""
    states = [state] if isinstance(state, str) else list(state or [])
    after = created_after.isoformat() if isinstance(created_after, datetime) else created_after
    return {
        "created_after": after,
        "state": states or None,
        "template": template,
        "metadata": [f"{key}={value}" for key, value in (metadata or {}).items()] or None,
        "order": order,
        "limit": limit,
        "page_token": page_token,
    }


def credential_body(
    name: str,
    *,
    value: str | None,
    hosts: Sequence[str] | None,
    header: str | None = None,
    project: str | None = None,
    method: str | None = None,
    query_param: str | None = None,
    scope: str | None = None,
    sandbox_id: str | None = None,
    env_var: str | None = None,
    expires_at: datetime | str | None = None,
    rate_per_minute: int | None = None,
) -> dict[str, Any]:
    """The body of PUT /v1/credentials/{name} (the name is in the path): only the fields given, so an
    update changes only those (a new credential needs value and hosts; the server says which is missing)."""
    if not name:
        raise InvalidArgument("a credential needs a name", field="name")
    if hosts is not None and not hosts:
        raise InvalidArgument("a credential needs at least one host", field="hosts")
    body: dict[str, Any] = {}
    optional: dict[str, Any] = {
        "value": value, "hosts": list(hosts) if hosts is not None else None, "header": header,
        "project": project, "method": method, "query_param": query_param, "scope": scope,
        "sandbox_id": sandbox_id, "env_var": env_var, "rate_per_minute": rate_per_minute,
        "expires_at": expires_at.isoformat() if isinstance(expires_at, datetime) else expires_at,
    }  # fmt: skip
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def egress_body(
    allow: Sequence[str] | None, deny: Sequence[str] | None, credentials: Sequence[str] | None
) -> dict[str, Any]:
    """PUT /v1/sandboxes/{id}/egress: a list left out (None) keeps its current value."""
    body: dict[str, Any] = {}
    for key, values in (("allow", allow), ("deny", deny), ("credentials", credentials)):
        if values is not None:
            body[key] = [values] if isinstance(values, str) else list(values)
    return body


def signal_name(sig: int | str) -> str:
    if isinstance(sig, int):
        try:
            return _signal.Signals(sig).name
        except ValueError as exc:
            raise InvalidArgument(f"unknown signal number {sig}") from exc
    name = sig.upper()
    return name if name.startswith("SIG") else f"SIG{name}"


def snapshot_id(snapshot: Snapshot | Mapping[str, Any] | str) -> str:
    if isinstance(snapshot, str):
        return snapshot
    value = snapshot.get("id")
    if not value:
        raise InvalidArgument("the snapshot has no id")
    return str(value)


def stream_error(event: Mapping[str, Any]) -> SpaceError | None:
    """An in-band error line (`{"type": "error", "error": {...}}`) of an NDJSON stream, as a typed error."""
    if event.get("type") != "error":
        return None
    inner = event.get("error")
    if isinstance(inner, dict):
        return error_from_dict(inner)
    return error_from_dict({"code": str(event.get("code", "internal")), "message": str(event.get("message"))})


def sandboxes_of(payload: Any) -> list[dict[str, Any]]:
    items = payload.get("sandboxes") if isinstance(payload, dict) else payload
    if not isinstance(items, list):
        raise SpaceError("unexpected answer: no list of sandboxes")
    return [dict(item) for item in items]
