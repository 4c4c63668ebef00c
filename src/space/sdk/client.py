"""The synchronous client: `Space`, and the handles it returns (Sandbox, Files, Processes, Snapshots, ...).

Invariants:
- A handle holds the server's last answer in `.data`; calls that change a sandbox replace it with the
  answer (lifecycle calls wait for the sandbox to settle by default, `wait=True`).
- Uploads from a file object or an iterator are streamed chunk by chunk; downloads via read_stream are
  iterated as they arrive. Only `files.read` returns a whole file in memory.
- The async client (space.sdk.aio) has the same names and arguments; keep the two in step.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import IO, Any, cast, overload

import httpx

from space.core.errors import NotFound, SpaceError
from space.sdk._http import SyncHTTP
from space.sdk.config import resolve_config
from space.sdk.models import (
    ApiKey,
    Command,
    Credential,
    ExecResult,
    ProcessEvent,
    Project,
    Snapshot,
    create_body,
    credential_body,
    egress_body,
    exec_body,
    process_body,
    sandboxes_of,
    seg,
    signal_name,
    snapshot_id,
)

__all__ = ["Files", "Process", "Processes", "Sandbox", "Sandboxes", "Snapshots", "Space"]

CHUNK = 256 * 1024
Uploadable = bytes | bytearray | memoryview | str | IO[bytes] | IO[str] | Iterable[bytes]
OnData = Callable[[bytes], object]


def upload_body(data: Uploadable, chunk_size: int = CHUNK) -> bytes | Iterator[bytes]:
    """bytes for in-memory data (replayable); a lazy chunk iterator for file objects and iterators."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(cast("IO[bytes] | IO[str]", data), chunk_size)
    return _iter_chunks(data)


def _read_chunks(handle: IO[bytes] | IO[str], chunk_size: int) -> Iterator[bytes]:
    while True:
        chunk = handle.read(chunk_size)
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


def _iter_chunks(chunks: Iterable[bytes]) -> Iterator[bytes]:
    for chunk in chunks:
        if chunk:
            yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


class Space:
    """A client of one SPACE server. `Space()` reads SPACE_URL/SPACE_API_KEY or the `space up` config file."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 10.0,
        max_retries: int = 3,
        retry_backoff: float = 0.25,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        config = resolve_config(url, api_key)
        self.url = config.url
        self._http = SyncHTTP(
            config.url,
            config.api_key,
            transport=transport,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            headers=headers,
        )
        self.sandboxes = Sandboxes(self._http)
        self.projects = Projects(self._http)
        self.keys = Keys(self._http)
        self.credentials = Credentials(self._http)

    def health(self) -> dict[str, Any]:
        """GET /healthz (unauthenticated)."""
        answer = self._http.json("GET", "/healthz")
        return dict(answer) if isinstance(answer, dict) else {"status": answer}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Space:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Space(url={self.url!r})"


class Sandboxes:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def create(
        self,
        template: str = "python",
        *,
        env: Mapping[str, str] | None = None,
        limits: Mapping[str, Any] | None = None,
        idle_timeout_s: int | None = None,
        ttl_s: int | None = None,
        allow: Sequence[str] | None = None,
        credentials: Sequence[str] | None = None,
        deny: Sequence[str] | None = None,
        snapshot_policy: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        wait: bool = True,
    ) -> Sandbox:
        body = create_body(
            template=template,
            env=env,
            limits=limits,
            idle_timeout_s=idle_timeout_s,
            ttl_s=ttl_s,
            allow=allow,
            credentials=credentials,
            wait=wait,
            deny=deny,
            snapshot_policy=snapshot_policy,
        )
        data = self._http.json("POST", "/v1/sandboxes", json_body=body, idempotency_key=idempotency_key)
        return Sandbox(self._http, data)

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._http, self._http.json("GET", f"/v1/sandboxes/{seg(sandbox_id)}"))

    def list(self) -> builtins.list[Sandbox]:
        return [Sandbox(self._http, item) for item in sandboxes_of(self._http.json("GET", "/v1/sandboxes"))]

    def ref(self, sandbox_id: str) -> Sandbox:
        """A handle on a sandbox by id, without asking the server (state unknown until refresh())."""
        seg(sandbox_id)
        return Sandbox(self._http, {"id": sandbox_id})


class Sandbox:
    def __init__(self, http: SyncHTTP, data: Mapping[str, Any]) -> None:
        self._http = http
        self.data: dict[str, Any] = dict(data)
        if not self.data.get("id"):
            raise SpaceError("unexpected answer: a sandbox without an id")
        self.files = Files(self)
        self.processes = Processes(self)
        self.snapshots = Snapshots(self)

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> str:
        return str(self.data.get("state", "unknown"))

    @property
    def path(self) -> str:
        return f"/v1/sandboxes/{seg(self.id)}"

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r})"

    def _update(self, data: Any) -> Sandbox:
        if isinstance(data, dict) and data.get("id"):
            self.data = dict(data)
        return self

    def refresh(self) -> Sandbox:
        return self._update(self._http.json("GET", self.path))

    # lifecycle ---------------------------------------------------------------------------------------

    def _action(self, action: str, wait: bool, idempotency_key: str | None) -> Sandbox:
        return self._update(
            self._http.json(
                "POST", f"{self.path}/{action}", params={"wait": wait}, idempotency_key=idempotency_key
            )
        )

    def pause(self, *, wait: bool = True, idempotency_key: str | None = None) -> Sandbox:
        return self._action("pause", wait, idempotency_key)

    def resume(self, *, wait: bool = True, idempotency_key: str | None = None) -> Sandbox:
        return self._action("resume", wait, idempotency_key)

    def stop(self, *, wait: bool = True, idempotency_key: str | None = None) -> Sandbox:
        return self._action("stop", wait, idempotency_key)

    def start(self, *, wait: bool = True, idempotency_key: str | None = None) -> Sandbox:
        return self._action("start", wait, idempotency_key)

    def suspend(self, *, wait: bool = True, idempotency_key: str | None = None) -> Sandbox:
        return self._action("suspend", wait, idempotency_key)

    def restore(self, *, wait: bool = True, idempotency_key: str | None = None) -> Sandbox:
        return self._action("restore", wait, idempotency_key)

    def set_snapshot_policy(self, policy: Mapping[str, Any] | None) -> Sandbox:
        """Scheduled snapshots and retention: {"disk_every_s", "full_every_s", "upload_full", "tiers":
        [{"every_s", "for_s"}, ...]}; None removes the policy."""
        body = {"snapshot_policy": dict(policy) if policy is not None else None}
        return self._update(self._http.json("PATCH", self.path, json_body=body))

    def delete(self, *, idempotency_key: str | None = None) -> Sandbox:
        return self._update(self._http.json("DELETE", self.path, idempotency_key=idempotency_key))

    @overload
    def fork(self, count: None = None, *, idempotency_key: str | None = None) -> Sandbox: ...
    @overload
    def fork(self, count: int, *, idempotency_key: str | None = None) -> builtins.list[Sandbox]: ...
    def fork(
        self, count: int | None = None, *, idempotency_key: str | None = None
    ) -> Sandbox | builtins.list[Sandbox]:
        """A new sandbox from this one's processes and files; fork(count=n) makes n and returns a list."""
        body = {"count": 1 if count is None else count}
        answer = self._http.json("POST", f"{self.path}/fork", json_body=body, idempotency_key=idempotency_key)
        children = [Sandbox(self._http, item) for item in sandboxes_of(answer)]
        if count is not None:
            return children
        if not children:
            raise SpaceError("unexpected answer: fork returned no sandbox")
        return children[0]

    def rollback(
        self, snapshot: Snapshot | Mapping[str, Any] | str, *, idempotency_key: str | None = None
    ) -> Sandbox:
        body = {"snapshot_id": snapshot_id(snapshot)}
        return self._update(
            self._http.json("POST", f"{self.path}/rollback", json_body=body, idempotency_key=idempotency_key)
        )

    # egress (issue 5) --------------------------------------------------------------------------------

    def egress(self) -> dict[str, Any]:
        """The sandbox's egress policy: {"allow", "deny", "credentials", "version"}."""
        return dict(self._http.json("GET", f"{self.path}/egress"))

    def set_egress(
        self,
        *,
        allow: Sequence[str] | None = None,
        deny: Sequence[str] | None = None,
        credentials: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Change the egress policy at run time (a list left out keeps its value); the answer says whether
        the node applied it at once ("applied")."""
        body = egress_body(allow, deny, credentials)
        return dict(self._http.json("PUT", f"{self.path}/egress", json_body=body))

    # commands ----------------------------------------------------------------------------------------

    def exec(
        self,
        cmd: Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        idempotency_key: str | None = None,
    ) -> ExecResult:
        """Run a command to completion: a str runs in a shell, a list is argv."""
        body = exec_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin, stream=False)
        answer = self._http.json(
            "POST",
            f"{self.path}/exec",
            json_body=body,
            idempotency_key=idempotency_key,
            timeout=self._http.timeout(None if timeout is None else timeout + 60),
        )
        return ExecResult.from_wire(answer)

    def exec_stream(
        self,
        cmd: Command,
        *,
        on_stdout: OnData | None = None,
        on_stderr: OnData | None = None,
        on_started: Callable[[str], object] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run a command, handing output to the callbacks as it arrives. Output of a channel without a
        callback is collected into the result; a channel with one is not kept."""
        body = exec_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin, stream=True)
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        process_id: str | None = None
        with self._http.stream(
            "POST", f"{self.path}/exec", json_body=body, timeout=self._http.timeout(None)
        ) as response:
            for raw in self._http.iter_ndjson(response):
                event = ProcessEvent.from_wire(raw)
                if event.type == "started":
                    process_id = event.process_id
                    if on_started is not None and process_id is not None:
                        on_started(process_id)
                elif event.type == "stdout":
                    (out.append if on_stdout is None else on_stdout)(event.data)
                elif event.type == "stderr":
                    (err.append if on_stderr is None else on_stderr)(event.data)
                elif event.type == "exit":
                    return ExecResult(
                        exit_code=event.exit_code,
                        stdout_bytes=b"".join(out),
                        stderr_bytes=b"".join(err),
                        process_id=event.process_id or process_id,
                        signal=event.signal,
                        timed_out=event.timed_out,
                        data=event.raw,
                    )
        raise SpaceError("the exec stream ended before the command's exit", process_id=process_id)


class Files:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/files"

    def write(self, path: str, data: Uploadable, *, mode: int | None = None, chunk_size: int = CHUNK) -> int:
        """Write a file from bytes/str, a binary file object or an iterator of bytes (streamed); returns
        the size written."""
        answer = self._http.json(
            "PUT",
            self._base,
            params={"path": path, "mode": mode},
            content=upload_body(data, chunk_size),
            headers={"Content-Type": "application/octet-stream"},
            timeout=self._http.timeout(None),
        )
        return int(answer.get("size", 0)) if isinstance(answer, dict) else 0

    def read(self, path: str) -> bytes:
        return self._http.send(
            "GET", self._base, params={"path": path}, timeout=self._http.timeout(None)
        ).content

    def read_stream(self, path: str, *, chunk_size: int | None = None) -> Iterator[bytes]:
        """The file's bytes as they arrive (never the whole file in memory)."""
        with self._http.stream(
            "GET", self._base, params={"path": path}, timeout=self._http.timeout(None)
        ) as r:
            yield from self._http.iter_bytes(r, chunk_size)

    def list(self, path: str) -> builtins.list[dict[str, Any]]:
        answer = self._http.json("GET", f"{self._base}/list", params={"path": path})
        return [dict(entry) for entry in answer.get("entries", [])]

    def stat(self, path: str) -> dict[str, Any]:
        return dict(self._http.json("GET", f"{self._base}/stat", params={"path": path}))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except NotFound:
            return False
        return True

    def mkdir(self, path: str, *, parents: bool = True) -> None:
        self._http.json("POST", f"{self._base}/mkdir", json_body={"path": path, "parents": parents})

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._http.json("DELETE", self._base, params={"path": path, "recursive": recursive})

    def rename(self, src: str, dst: str) -> None:
        self._http.json("POST", f"{self._base}/rename", json_body={"src": src, "dst": dst})

    def watch(self, path: str, *, recursive: bool = False) -> Iterator[dict[str, Any]]:
        """Change events as they happen: {"type": "watching", ...} once the watch is set up, then
        {"type": "changes", "changes": [{"path", "kind"}, ...]}. Stop by closing or leaving the loop."""
        with self._http.stream(
            "GET",
            f"{self._base}/watch",
            params={"path": path, "recursive": recursive},
            timeout=self._http.timeout(None),
        ) as response:
            yield from self._http.iter_ndjson(response)


class Process:
    """A background process in a sandbox (`.id` is its process id, `.pid` its pid in the sandbox)."""

    def __init__(self, sandbox: Sandbox, data: Mapping[str, Any]) -> None:
        self._sandbox = sandbox
        self.data: dict[str, Any] = dict(data)

    @property
    def id(self) -> str:
        return str(self.data["process_id"])

    @property
    def pid(self) -> int | None:
        value = self.data.get("pid")
        return int(value) if value is not None else None

    @property
    def running(self) -> bool | None:
        value = self.data.get("running")
        return None if value is None else bool(value)

    def __repr__(self) -> str:
        return f"Process(id={self.id!r}, pid={self.pid!r})"

    def attach(self, offset: int = 0, *, follow: bool = True) -> Iterator[ProcessEvent]:
        return self._sandbox.processes.attach(self.id, offset=offset, follow=follow)

    def signal(self, sig: int | str = "SIGTERM") -> None:
        self._sandbox.processes.signal(self.id, sig)

    def write_stdin(self, data: bytes, *, eof: bool = False) -> int:
        return self._sandbox.processes.write_stdin(self.id, data, eof=eof)

    def close_stdin(self) -> None:
        self._sandbox.processes.write_stdin(self.id, b"", eof=True)

    def wait(self) -> ExecResult:
        """Follow the output from the start until the process exits; the output is collected."""
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        for event in self.attach(0):
            if event.type == "stdout":
                out.append(event.data)
            elif event.type == "stderr":
                err.append(event.data)
            elif event.type == "exit":
                return ExecResult(
                    exit_code=event.exit_code,
                    stdout_bytes=b"".join(out),
                    stderr_bytes=b"".join(err),
                    process_id=self.id,
                    signal=event.signal,
                    timed_out=event.timed_out,
                    data=event.raw,
                )
        raise SpaceError("the output stream ended before the process's exit", process_id=self.id)


def _process_id(process: Process | str | int) -> str:
    return process.id if isinstance(process, Process) else str(process)


class Processes:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/processes"

    def start(
        self,
        cmd: Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        tag: str | None = None,
        pty: tuple[int, int] | None = None,
        idempotency_key: str | None = None,
    ) -> Process:
        """Start a background process (it outlives this call); `pty=(rows, cols)` gives it a terminal."""
        body = process_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, tag=tag, pty=pty)
        answer = self._http.json("POST", self._base, json_body=body, idempotency_key=idempotency_key)
        return Process(self._sandbox, answer)

    def list(self) -> builtins.list[Process]:
        answer = self._http.json("GET", self._base)
        return [Process(self._sandbox, item) for item in answer.get("processes", [])]

    def attach(
        self, process: Process | str | int, *, offset: int = 0, follow: bool = True
    ) -> Iterator[ProcessEvent]:
        """The process's output from `offset`: an "attached" event, then stdout/stderr events, then "exit"
        (with follow=False, only what is already there)."""
        with self._http.stream(
            "GET",
            f"{self._base}/{seg(_process_id(process))}/output",
            params={"offset": offset, "follow": follow},
            timeout=self._http.timeout(None),
        ) as response:
            for raw in self._http.iter_ndjson(response):
                yield ProcessEvent.from_wire(raw)

    def signal(self, process: Process | str | int, sig: int | str = "SIGTERM") -> None:
        self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/signal",
            json_body={"signal": signal_name(sig)},
        )

    def write_stdin(self, process: Process | str | int, data: bytes, *, eof: bool = False) -> int:
        answer = self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/stdin",
            params={"eof": eof},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(answer.get("written", 0)) if isinstance(answer, dict) else 0


class Snapshots:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    def create(self, *, full: bool = False, idempotency_key: str | None = None) -> Snapshot:
        """A disk snapshot, or with full=True a full checkpoint (processes and memory too)."""
        answer = self._http.json(
            "POST",
            f"{self._sandbox.path}/snapshots",
            json_body={"full": full},
            idempotency_key=idempotency_key,
        )
        return Snapshot(answer)

    def list(self) -> builtins.list[Snapshot]:
        answer = self._http.json("GET", f"{self._sandbox.path}/snapshots")
        return [Snapshot(item) for item in answer.get("snapshots", [])]


class Projects:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def create(self, name: str, *, idempotency_key: str | None = None) -> Project:
        return Project(
            self._http.json("POST", "/v1/projects", json_body={"name": name}, idempotency_key=idempotency_key)
        )

    def list(self) -> builtins.list[Project]:
        return [Project(item) for item in self._http.json("GET", "/v1/projects").get("projects", [])]


class Keys:
    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def create(self, *, project: str, role: str = "member", idempotency_key: str | None = None) -> ApiKey:
        """A new API key for `project` (name or id); its secret `.key` is shown only in this answer."""
        body = {"project": project, "role": role}
        return ApiKey(self._http.json("POST", "/v1/keys", json_body=body, idempotency_key=idempotency_key))

    def delete(self, key_id: str) -> None:
        self._http.send("DELETE", f"/v1/keys/{seg(key_id)}")


class Credentials:
    """Credentials the egress gateway injects into requests to their hosts; the value is write-only (no
    call returns it) and sandboxes see only its placeholder."""

    def __init__(self, http: SyncHTTP) -> None:
        self._http = http

    def set(
        self,
        name: str,
        *,
        value: str | None = None,
        hosts: str | Sequence[str] | None = None,
        header: str | None = None,
        project: str | None = None,
        method: str | None = None,
        query_param: str | None = None,
        scope: str | None = None,
        sandbox_id: str | None = None,
        env_var: str | None = None,
        expires_at: datetime | str | None = None,
        rate_per_minute: int | None = None,
    ) -> Credential:
        """Create, update or rotate (a new `value`) a credential. `header` is e.g. 'Authorization: Bearer
        {value}'; or `method` "bearer" (default), "basic" (value 'user:password') or "query" (with
        `query_param`). `scope` is "project" (default), "org" (org admin keys) or "sandbox" (with
        `sandbox_id`); the most specific one of a name wins for a sandbox."""
        host_list = [hosts] if isinstance(hosts, str) else (list(hosts) if hosts is not None else None)
        body = credential_body(
            name, value=value, hosts=host_list, header=header, project=project, method=method,
            query_param=query_param, scope=scope, sandbox_id=sandbox_id, env_var=env_var,
            expires_at=expires_at, rate_per_minute=rate_per_minute,
        )  # fmt: skip
        return Credential(self._http.json("PUT", f"/v1/credentials/{seg(name)}", json_body=body))

    def list(self, *, project: str | None = None) -> builtins.list[Credential]:
        answer = self._http.json("GET", "/v1/credentials", params={"project": project})
        return [Credential(item) for item in answer.get("credentials", [])]

    def delete(
        self, name: str, *, scope: str = "project", sandbox_id: str | None = None, project: str | None = None
    ) -> None:
        params = {"scope": scope, "sandbox_id": sandbox_id, "project": project}
        self._http.json("DELETE", f"/v1/credentials/{seg(name)}", params=params)

    def audit(
        self,
        name: str,
        *,
        scope: str = "project",
        sandbox_id: str | None = None,
        after: int = 0,
        limit: int = 100,
    ) -> builtins.list[dict[str, Any]]:
        """The audit log of a credential (changes and uses), oldest first; page with `after` (an entry id)."""
        params = {"scope": scope, "sandbox_id": sandbox_id, "after": after, "limit": limit}
        answer = self._http.json("GET", f"/v1/credentials/{seg(name)}/audit", params=params)
        return [dict(entry) for entry in answer.get("entries", [])]
