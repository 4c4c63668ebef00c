"""The asynchronous client: `AsyncSpace`, the same surface as space.sdk.client.Space with `await`.

Streams are async iterators (`async for chunk in sb.files.read_stream(path)`); exec_stream callbacks may be
plain functions or coroutine functions. Keep this module in step with space.sdk.client.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import IO, Any, cast, overload

import httpx

from space.core.errors import NotFound, SpaceError
from space.sdk._http import AsyncHTTP
from space.sdk.client import CHUNK
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

__all__ = [
    "AsyncFiles",
    "AsyncProcess",
    "AsyncProcesses",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSnapshots",
    "AsyncSpace",
]

AsyncUploadable = (
    bytes | bytearray | memoryview | str | IO[bytes] | IO[str] | Iterable[bytes] | AsyncIterable[bytes]
)
OnData = Callable[[bytes], object] | Callable[[bytes], Awaitable[object]]


def async_upload_body(data: AsyncUploadable, chunk_size: int = CHUNK) -> bytes | AsyncIterator[bytes]:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(cast("IO[bytes] | IO[str]", data), chunk_size)
    if isinstance(data, AsyncIterable):
        return _aiter_chunks(data)
    return _iter_chunks(data)


async def _read_chunks(handle: IO[bytes] | IO[str], chunk_size: int) -> AsyncIterator[bytes]:
    while True:
        chunk: bytes | str = await asyncio.to_thread(handle.read, chunk_size)
        if not chunk:
            return
        yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


async def _aiter_chunks(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        if chunk:
            yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


async def _iter_chunks(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        if chunk:
            yield chunk.encode("utf-8") if isinstance(chunk, str) else bytes(chunk)


async def _call(callback: Callable[..., object], *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


class AsyncSpace:
    """The async twin of Space: `async with AsyncSpace() as sp: sb = await sp.sandboxes.create()`."""

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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        config = resolve_config(url, api_key)
        self.url = config.url
        self._http = AsyncHTTP(
            config.url,
            config.api_key,
            transport=transport,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            headers=headers,
        )
        self.sandboxes = AsyncSandboxes(self._http)
        self.projects = AsyncProjects(self._http)
        self.keys = AsyncKeys(self._http)
        self.credentials = AsyncCredentials(self._http)

    async def health(self) -> dict[str, Any]:
        answer = await self._http.json("GET", "/healthz")
        return dict(answer) if isinstance(answer, dict) else {"status": answer}

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncSpace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSpace(url={self.url!r})"


class AsyncSandboxes:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def create(
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
    ) -> AsyncSandbox:
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
        data = await self._http.json("POST", "/v1/sandboxes", json_body=body, idempotency_key=idempotency_key)
        return AsyncSandbox(self._http, data)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._http, await self._http.json("GET", f"/v1/sandboxes/{seg(sandbox_id)}"))

    async def list(self) -> builtins.list[AsyncSandbox]:
        answer = await self._http.json("GET", "/v1/sandboxes")
        return [AsyncSandbox(self._http, item) for item in sandboxes_of(answer)]

    def ref(self, sandbox_id: str) -> AsyncSandbox:
        seg(sandbox_id)
        return AsyncSandbox(self._http, {"id": sandbox_id})


class AsyncSandbox:
    def __init__(self, http: AsyncHTTP, data: Mapping[str, Any]) -> None:
        self._http = http
        self.data: dict[str, Any] = dict(data)
        if not self.data.get("id"):
            raise SpaceError("unexpected answer: a sandbox without an id")
        self.files = AsyncFiles(self)
        self.processes = AsyncProcesses(self)
        self.snapshots = AsyncSnapshots(self)

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
        return f"AsyncSandbox(id={self.id!r}, state={self.state!r})"

    def _update(self, data: Any) -> AsyncSandbox:
        if isinstance(data, dict) and data.get("id"):
            self.data = dict(data)
        return self

    async def refresh(self) -> AsyncSandbox:
        return self._update(await self._http.json("GET", self.path))

    async def _action(self, action: str, wait: bool, idempotency_key: str | None) -> AsyncSandbox:
        answer = await self._http.json(
            "POST", f"{self.path}/{action}", params={"wait": wait}, idempotency_key=idempotency_key
        )
        return self._update(answer)

    async def pause(self, *, wait: bool = True, idempotency_key: str | None = None) -> AsyncSandbox:
        return await self._action("pause", wait, idempotency_key)

    async def resume(self, *, wait: bool = True, idempotency_key: str | None = None) -> AsyncSandbox:
        return await self._action("resume", wait, idempotency_key)

    async def stop(self, *, wait: bool = True, idempotency_key: str | None = None) -> AsyncSandbox:
        return await self._action("stop", wait, idempotency_key)

    async def start(self, *, wait: bool = True, idempotency_key: str | None = None) -> AsyncSandbox:
        return await self._action("start", wait, idempotency_key)

    async def suspend(self, *, wait: bool = True, idempotency_key: str | None = None) -> AsyncSandbox:
        return await self._action("suspend", wait, idempotency_key)

    async def restore(self, *, wait: bool = True, idempotency_key: str | None = None) -> AsyncSandbox:
        return await self._action("restore", wait, idempotency_key)

    async def set_snapshot_policy(self, policy: Mapping[str, Any] | None) -> AsyncSandbox:
        """Scheduled snapshots and retention: {"disk_every_s", "full_every_s", "upload_full", "tiers":
        [{"every_s", "for_s"}, ...]}; None removes the policy."""
        body = {"snapshot_policy": dict(policy) if policy is not None else None}
        return self._update(await self._http.json("PATCH", self.path, json_body=body))

    async def delete(self, *, idempotency_key: str | None = None) -> AsyncSandbox:
        return self._update(await self._http.json("DELETE", self.path, idempotency_key=idempotency_key))

    @overload
    async def fork(self, count: None = None, *, idempotency_key: str | None = None) -> AsyncSandbox: ...
    @overload
    async def fork(
        self, count: int, *, idempotency_key: str | None = None
    ) -> builtins.list[AsyncSandbox]: ...
    async def fork(
        self, count: int | None = None, *, idempotency_key: str | None = None
    ) -> AsyncSandbox | builtins.list[AsyncSandbox]:
        body = {"count": 1 if count is None else count}
        answer = await self._http.json(
            "POST", f"{self.path}/fork", json_body=body, idempotency_key=idempotency_key
        )
        children = [AsyncSandbox(self._http, item) for item in sandboxes_of(answer)]
        if count is not None:
            return children
        if not children:
            raise SpaceError("unexpected answer: fork returned no sandbox")
        return children[0]

    async def rollback(
        self, snapshot: Snapshot | Mapping[str, Any] | str, *, idempotency_key: str | None = None
    ) -> AsyncSandbox:
        body = {"snapshot_id": snapshot_id(snapshot)}
        answer = await self._http.json(
            "POST", f"{self.path}/rollback", json_body=body, idempotency_key=idempotency_key
        )
        return self._update(answer)

    # egress (issue 5) --------------------------------------------------------------------------------

    async def egress(self) -> dict[str, Any]:
        """The sandbox's egress policy: {"allow", "deny", "credentials", "version"}."""
        return dict(await self._http.json("GET", f"{self.path}/egress"))

    async def set_egress(
        self,
        *,
        allow: Sequence[str] | None = None,
        deny: Sequence[str] | None = None,
        credentials: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Change the egress policy at run time (a list left out keeps its value); the answer says whether
        the node applied it at once ("applied")."""
        body = egress_body(allow, deny, credentials)
        return dict(await self._http.json("PUT", f"{self.path}/egress", json_body=body))

    async def exec(
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
        body = exec_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin, stream=False)
        answer = await self._http.json(
            "POST",
            f"{self.path}/exec",
            json_body=body,
            idempotency_key=idempotency_key,
            timeout=self._http.timeout(None if timeout is None else timeout + 60),
        )
        return ExecResult.from_wire(answer)

    async def exec_stream(
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
        body = exec_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin, stream=True)
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        process_id: str | None = None
        async with self._http.stream(
            "POST", f"{self.path}/exec", json_body=body, timeout=self._http.timeout(None)
        ) as response:
            async for raw in self._http.iter_ndjson(response):
                event = ProcessEvent.from_wire(raw)
                if event.type == "started":
                    process_id = event.process_id
                    if on_started is not None and process_id is not None:
                        await _call(on_started, process_id)
                elif event.type == "stdout":
                    if on_stdout is None:
                        out.append(event.data)
                    else:
                        await _call(on_stdout, event.data)
                elif event.type == "stderr":
                    if on_stderr is None:
                        err.append(event.data)
                    else:
                        await _call(on_stderr, event.data)
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


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/files"

    async def write(
        self, path: str, data: AsyncUploadable, *, mode: int | None = None, chunk_size: int = CHUNK
    ) -> int:
        answer = await self._http.json(
            "PUT",
            self._base,
            params={"path": path, "mode": mode},
            content=async_upload_body(data, chunk_size),
            headers={"Content-Type": "application/octet-stream"},
            timeout=self._http.timeout(None),
        )
        return int(answer.get("size", 0)) if isinstance(answer, dict) else 0

    async def read(self, path: str) -> bytes:
        response = await self._http.send(
            "GET", self._base, params={"path": path}, timeout=self._http.timeout(None)
        )
        return response.content

    async def read_stream(self, path: str, *, chunk_size: int | None = None) -> AsyncIterator[bytes]:
        async with self._http.stream(
            "GET", self._base, params={"path": path}, timeout=self._http.timeout(None)
        ) as response:
            async for chunk in self._http.iter_bytes(response, chunk_size):
                yield chunk

    async def list(self, path: str) -> builtins.list[dict[str, Any]]:
        answer = await self._http.json("GET", f"{self._base}/list", params={"path": path})
        return [dict(entry) for entry in answer.get("entries", [])]

    async def stat(self, path: str) -> dict[str, Any]:
        return dict(await self._http.json("GET", f"{self._base}/stat", params={"path": path}))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, *, parents: bool = True) -> None:
        await self._http.json("POST", f"{self._base}/mkdir", json_body={"path": path, "parents": parents})

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._http.json("DELETE", self._base, params={"path": path, "recursive": recursive})

    async def rename(self, src: str, dst: str) -> None:
        await self._http.json("POST", f"{self._base}/rename", json_body={"src": src, "dst": dst})

    async def watch(self, path: str, *, recursive: bool = False) -> AsyncIterator[dict[str, Any]]:
        async with self._http.stream(
            "GET",
            f"{self._base}/watch",
            params={"path": path, "recursive": recursive},
            timeout=self._http.timeout(None),
        ) as response:
            async for event in self._http.iter_ndjson(response):
                yield event


class AsyncProcess:
    def __init__(self, sandbox: AsyncSandbox, data: Mapping[str, Any]) -> None:
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
        return f"AsyncProcess(id={self.id!r}, pid={self.pid!r})"

    def attach(self, offset: int = 0, *, follow: bool = True) -> AsyncIterator[ProcessEvent]:
        return self._sandbox.processes.attach(self.id, offset=offset, follow=follow)

    async def signal(self, sig: int | str = "SIGTERM") -> None:
        await self._sandbox.processes.signal(self.id, sig)

    async def write_stdin(self, data: bytes, *, eof: bool = False) -> int:
        return await self._sandbox.processes.write_stdin(self.id, data, eof=eof)

    async def close_stdin(self) -> None:
        await self._sandbox.processes.write_stdin(self.id, b"", eof=True)

    async def wait(self) -> ExecResult:
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        async for event in self.attach(0):
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


def _process_id(process: AsyncProcess | str | int) -> str:
    return process.id if isinstance(process, AsyncProcess) else str(process)


class AsyncProcesses:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    @property
    def _base(self) -> str:
        return f"{self._sandbox.path}/processes"

    async def start(
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
    ) -> AsyncProcess:
        body = process_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, tag=tag, pty=pty)
        answer = await self._http.json("POST", self._base, json_body=body, idempotency_key=idempotency_key)
        return AsyncProcess(self._sandbox, answer)

    async def list(self) -> builtins.list[AsyncProcess]:
        answer = await self._http.json("GET", self._base)
        return [AsyncProcess(self._sandbox, item) for item in answer.get("processes", [])]

    async def attach(
        self, process: AsyncProcess | str | int, *, offset: int = 0, follow: bool = True
    ) -> AsyncIterator[ProcessEvent]:
        async with self._http.stream(
            "GET",
            f"{self._base}/{seg(_process_id(process))}/output",
            params={"offset": offset, "follow": follow},
            timeout=self._http.timeout(None),
        ) as response:
            async for raw in self._http.iter_ndjson(response):
                yield ProcessEvent.from_wire(raw)

    async def signal(self, process: AsyncProcess | str | int, sig: int | str = "SIGTERM") -> None:
        await self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/signal",
            json_body={"signal": signal_name(sig)},
        )

    async def write_stdin(self, process: AsyncProcess | str | int, data: bytes, *, eof: bool = False) -> int:
        answer = await self._http.json(
            "POST",
            f"{self._base}/{seg(_process_id(process))}/stdin",
            params={"eof": eof},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )
        return int(answer.get("written", 0)) if isinstance(answer, dict) else 0


class AsyncSnapshots:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    async def create(self, *, full: bool = False, idempotency_key: str | None = None) -> Snapshot:
        answer = await self._http.json(
            "POST",
            f"{self._sandbox.path}/snapshots",
            json_body={"full": full},
            idempotency_key=idempotency_key,
        )
        return Snapshot(answer)

    async def list(self) -> builtins.list[Snapshot]:
        answer = await self._http.json("GET", f"{self._sandbox.path}/snapshots")
        return [Snapshot(item) for item in answer.get("snapshots", [])]


class AsyncProjects:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def create(self, name: str, *, idempotency_key: str | None = None) -> Project:
        answer = await self._http.json(
            "POST", "/v1/projects", json_body={"name": name}, idempotency_key=idempotency_key
        )
        return Project(answer)

    async def list(self) -> builtins.list[Project]:
        answer = await self._http.json("GET", "/v1/projects")
        return [Project(item) for item in answer.get("projects", [])]


class AsyncKeys:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def create(
        self, *, project: str, role: str = "member", idempotency_key: str | None = None
    ) -> ApiKey:
        body = {"project": project, "role": role}
        return ApiKey(
            await self._http.json("POST", "/v1/keys", json_body=body, idempotency_key=idempotency_key)
        )

    async def delete(self, key_id: str) -> None:
        await self._http.send("DELETE", f"/v1/keys/{seg(key_id)}")


class AsyncCredentials:
    """Credentials the egress gateway injects into requests to their hosts; the value is write-only (no
    call returns it) and sandboxes see only its placeholder."""

    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def set(
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
        return Credential(await self._http.json("PUT", f"/v1/credentials/{seg(name)}", json_body=body))

    async def list(self, *, project: str | None = None) -> builtins.list[Credential]:
        answer = await self._http.json("GET", "/v1/credentials", params={"project": project})
        return [Credential(item) for item in answer.get("credentials", [])]

    async def delete(
        self, name: str, *, scope: str = "project", sandbox_id: str | None = None, project: str | None = None
    ) -> None:
        params = {"scope": scope, "sandbox_id": sandbox_id, "project": project}
        await self._http.json("DELETE", f"/v1/credentials/{seg(name)}", params=params)

    async def audit(
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
        answer = await self._http.json("GET", f"/v1/credentials/{seg(name)}/audit", params=params)
        return [dict(entry) for entry in answer.get("entries", [])]
