"""Sandboxes: create/get/list, and a sandbox's lifecycle, egress policy, commands and snapshots.

Invariants:
- A handle holds the server's last answer in `.data`; calls that change a sandbox replace it with the
  answer (lifecycle calls wait for the sandbox to settle by default, `wait=True`; delete answers once the
  sandbox is `deleting`, its teardown in the background, unless `wait=True`).
- exec returns when the command has ended; exec_stream hands output to its callbacks as it arrives (a
  channel without a callback is collected into the result, a channel with one is not kept).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, overload

from space.core.errors import SpaceError
from space.sdk._async.files import AsyncFiles
from space.sdk._async.http import AsyncHTTP, AsyncSandboxRef
from space.sdk._async.processes import AsyncProcesses
from space.sdk._backend import AsyncBackend, AsyncOnData
from space.sdk.browser import AsyncBrowser
from space.sdk.code import CodeExecution
from space.sdk.models import (
    Command,
    ExecResult,
    MetricSample,
    OutputCollector,
    ProcessEvent,
    SandboxEvent,
    Snapshot,
    create_body,
    egress_body,
    exec_body,
    list_params,
    metrics_params,
    sandboxes_of,
    seg,
    snapshot_id,
)

__all__ = ["AsyncProjectSnapshots", "AsyncSandbox", "AsyncSandboxPage", "AsyncSandboxes", "AsyncSnapshots"]


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
        metadata: Mapping[str, str] | None = None,
        on_timeout: str | None = None,
        from_snapshot: str | None = None,
        isolation: str | None = None,
    ) -> AsyncSandbox:
        """A new sandbox. `ttl_s` is its deadline in seconds (reset with `set_timeout`); at the deadline
        `on_timeout` "delete" (the default) deletes it, "pause" keeps it suspended (paused without object
        storage) until it is used again. `metadata` labels it for `list(metadata=...)`. `from_snapshot`
        (a full snapshot's id or name) starts it from that checkpoint, with its source's template, limits,
        egress policy and isolation. `isolation` "gvisor" (the server's default) or "microvm" (a QEMU
        microVM on its own Linux kernel, on a node that runs them)."""
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
            metadata=metadata,
            on_timeout=on_timeout,
            from_snapshot=from_snapshot,
            isolation=isolation,
        )
        data = await self._http.json("POST", "/v1/sandboxes", json_body=body, idempotency_key=idempotency_key)
        return AsyncSandbox(self._http, data)

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self._http, await self._http.json("GET", f"/v1/sandboxes/{seg(sandbox_id)}"))

    async def list(
        self,
        *,
        state: str | Sequence[str] | None = None,
        template: str | None = None,
        metadata: Mapping[str, str] | None = None,
        order: str = "desc",
        created_after: datetime | str | None = None,
    ) -> builtins.list[AsyncSandbox]:
        """Every sandbox of the project that matches (all pages; newest first unless order="asc"):
        `state` one or more states (none: all but deleted), `metadata` pairs that must all match,
        `created_after` an aware time (inclusive)."""
        found: builtins.list[AsyncSandbox] = []
        token: str | None = None
        while True:
            page = await self.list_page(
                state=state, template=template, metadata=metadata, order=order, page_token=token,
                created_after=created_after,
            )  # fmt: skip
            found += page.sandboxes
            if page.next_page_token is None:
                return found
            token = page.next_page_token

    async def list_page(
        self,
        *,
        state: str | Sequence[str] | None = None,
        template: str | None = None,
        metadata: Mapping[str, str] | None = None,
        order: str = "desc",
        limit: int | None = None,
        page_token: str | None = None,
        created_after: datetime | str | None = None,
    ) -> AsyncSandboxPage:
        """One page of `list` (at most `limit`, 1 to 1000, default 100); pass its `next_page_token` with
        the same filters for the next one (None: this was the last)."""
        params = list_params(
            state=state, template=template, metadata=metadata, order=order, limit=limit,
            page_token=page_token, created_after=created_after,
        )  # fmt: skip
        answer = await self._http.json("GET", "/v1/sandboxes", params=params)
        sandboxes = [AsyncSandbox(self._http, item) for item in sandboxes_of(answer)]
        token = answer.get("next_page_token") if isinstance(answer, dict) else None
        return AsyncSandboxPage(sandboxes, str(token) if token else None)

    def ref(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on a sandbox by id, without asking the server (state unknown until refresh())."""
        seg(sandbox_id)
        return AsyncSandbox(self._http, {"id": sandbox_id})


class AsyncSandboxPage:
    """One page of a sandbox list and the token of the next (None: the last page)."""

    def __init__(self, sandboxes: builtins.list[AsyncSandbox], next_page_token: str | None) -> None:
        self.sandboxes = sandboxes
        self.next_page_token = next_page_token

    def __repr__(self) -> str:
        count = len(self.sandboxes)
        return f"{type(self).__name__}({count} sandboxes, next_page_token={self.next_page_token!r})"


class AsyncSandbox:
    def __init__(self, http: AsyncHTTP, data: Mapping[str, Any]) -> None:
        self._http = http
        self.data: dict[str, Any] = dict(data)
        if not self.data.get("id"):
            raise SpaceError("unexpected answer: a sandbox without an id")
        self.files = AsyncFiles(self)
        self.processes = AsyncProcesses(self)
        # A `browser` sandbox's Chromium (ADR 0064): cdp_url()/cdp_headers() for Playwright, screenshot().
        self.browser = AsyncBrowser(http, self.data["id"])
        self.snapshots = AsyncSnapshots(self)

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> str:
        return str(self.data.get("state", "unknown"))

    @property
    def created_from(self) -> str | None:
        """How its node made it: "pool", "warm" (no pooled sandbox was ready) or "cold"; None for a fork,
        while it is being created, or from an older server."""
        value = self.data.get("created_from")
        return None if value is None else str(value)

    @property
    def isolation(self) -> str:
        """ "gvisor" or "microvm" (fixed at create); "gvisor" from an older server, which ran nothing else."""
        return str(self.data.get("isolation") or "gvisor")

    @property
    def metadata(self) -> dict[str, str]:
        """Its labels (as of the last answer)."""
        return dict(self.data.get("metadata") or {})

    @property
    def expires_at(self) -> str | None:
        """Its deadline, ISO 8601 (None: none), as of the last answer; what happens then is on_timeout."""
        value = self.data.get("expires_at")
        return None if value is None else str(value)

    @property
    def path(self) -> str:
        return f"/v1/sandboxes/{seg(self.id)}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, state={self.state!r})"

    def _update(self, data: Any) -> AsyncSandbox:
        if isinstance(data, dict) and data.get("id"):
            self.data = dict(data)
        return self

    async def refresh(self) -> AsyncSandbox:
        return self._update(await self._http.json("GET", self.path))

    # lifecycle ---------------------------------------------------------------------------------------

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

    async def set_timeout(self, timeout_s: int, *, extend_only: bool = False) -> AsyncSandbox:
        """Its deadline becomes now + timeout_s seconds (0: now; it may shorten it), and timeout_s its
        timeout for later resumes; with extend_only the deadline only moves later."""
        body = {"timeout_s": timeout_s, "extend_only": extend_only}
        return self._update(await self._http.json("POST", f"{self.path}/timeout", json_body=body))

    async def set_snapshot_policy(self, policy: Mapping[str, Any] | None) -> AsyncSandbox:
        """Scheduled snapshots and retention: {"disk_every_s", "full_every_s", "upload_full", "tiers":
        [{"every_s", "for_s"}, ...]}; None removes the policy."""
        body = {"snapshot_policy": dict(policy) if policy is not None else None}
        return self._update(await self._http.json("PATCH", self.path, json_body=body))

    async def delete(self, *, wait: bool = False, idempotency_key: str | None = None) -> AsyncSandbox:
        """The sandbox is `deleting` when this returns (every other call on it is refused from then on)
        and its teardown goes on in the background; with wait=True this returns once it is `deleted`."""
        answer = await self._http.json(
            "DELETE", self.path, params={"wait": wait}, idempotency_key=idempotency_key
        )
        return self._update(answer)

    @overload
    async def fork(self, count: None = None, *, idempotency_key: str | None = None) -> AsyncSandbox: ...
    @overload
    async def fork(
        self, count: int, *, idempotency_key: str | None = None
    ) -> builtins.list[AsyncSandbox]: ...
    async def fork(
        self, count: int | None = None, *, idempotency_key: str | None = None
    ) -> AsyncSandbox | builtins.list[AsyncSandbox]:
        """A new sandbox from this one's processes and files; fork(count=n) makes n and returns a list."""
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

    # events ------------------------------------------------------------------------------------------

    async def events(
        self, *, after: int = 0, limit: int = 100, kind: str | None = None
    ) -> builtins.list[SandboxEvent]:
        """What happened to the sandbox beyond its state (`sandbox.crashed`, `sandbox.recovered`, ...),
        oldest first: at most `limit` (1 to 500) with an id above `after`, of one `kind` if given."""
        params: dict[str, str | int | None] = {"after": after, "limit": limit, "kind": kind}
        answer = await self._http.json("GET", f"{self.path}/events", params=params)
        return [SandboxEvent(item) for item in answer.get("events", [])]

    # metrics -----------------------------------------------------------------------------------------

    async def metrics(
        self,
        *,
        start: float | datetime | None = None,
        end: float | datetime | None = None,
        limit: int | None = None,
    ) -> builtins.list[MetricSample]:
        """The sandbox's CPU, memory and disk every few seconds (the last hour by default), oldest first:
        samples with start <= timestamp <= end (Unix seconds or datetimes), at most `limit` (1 to 1000)
        newest ones. Empty while none were taken yet, and for a sandbox on no node (suspended)."""
        params = metrics_params(start, end, limit)
        answer = await self._http.json("GET", f"{self.path}/metrics", params=params)
        return [MetricSample(item) for item in answer.get("samples", [])]

    async def traces(self, *, limit: int = 10) -> builtins.list[dict[str, Any]]:
        """The sandbox's newest `limit` operations (1 to 100) as traces, oldest first: each
        {"trace_id", "spans": [{"name", "layer", "start_ns", "end_ns", "parent_id", ...}]} with the spans of
        the control plane, the node agent, the root helper and spaced (what `space trace` draws)."""
        answer = await self._http.json("GET", f"{self.path}/traces", params={"limit": limit})
        return [dict(item) for item in answer.get("traces", [])]

    # egress ------------------------------------------------------------------------------------------

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

    async def login_placeholders(self, credential: str) -> dict[str, Any]:
        """What to type into the login form of `credential` (a `login` credential bound to this sandbox):
        {"credential", "origin", "form_action", "fields": {field: placeholder}}. The egress gateway replaces
        the placeholders with the username and password only in that origin's form submission (ADR 0063)."""
        path = f"{self.path}/credentials/{seg(credential)}/login"
        return dict(await self._http.json("POST", path))

    # commands ----------------------------------------------------------------------------------------

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
        """Run a command to completion: a str runs in a shell, a list is argv."""
        body = exec_body(cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin, stream=False)
        answer = await self._http.json(
            "POST",
            f"{self.path}/exec",
            json_body=body,
            idempotency_key=idempotency_key,
            timeout=self._http.timeout(None if timeout is None else timeout + 60),
        )
        return ExecResult.from_wire(answer)

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        context: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        on_event: Callable[[dict[str, Any]], object] | None = None,
    ) -> CodeExecution:
        """Run code in the sandbox's Jupyter kernel (a sandbox of the code-interpreter template): results in
        every format the kernel gave (PNGs as base64), output and error; `context` names a kernel context
        (default: the default one, whose variables stay between calls); `timeout` interrupts the kernel."""
        body: dict[str, Any] = {"code": code, "language": language}
        if context is not None:
            body["context"] = context
        if env:
            body["env"] = dict(env)
        if timeout is not None:
            body["timeout"] = timeout
        execution = CodeExecution()
        async with self._http.stream(
            "POST", f"{self.path}/code", json_body=body, timeout=self._http.timeout(None)
        ) as response:
            async for raw in self._http.iter_ndjson(response):
                execution.take(raw)
                if on_event is not None:
                    await AsyncBackend.call(on_event, raw)
        if not execution.finished:
            raise SpaceError("the code stream ended before the end of the execution")
        return execution

    async def exec_stream(
        self,
        cmd: Command,
        *,
        on_stdout: AsyncOnData | None = None,
        on_stderr: AsyncOnData | None = None,
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
        output = OutputCollector()
        process_id: str | None = None
        async with self._http.stream(
            "POST", f"{self.path}/exec", json_body=body, timeout=self._http.timeout(None)
        ) as response:
            async for raw in self._http.iter_ndjson(response):
                event = ProcessEvent.from_wire(raw)
                if event.type == "started":
                    process_id = event.process_id
                    if on_started is not None and process_id is not None:
                        await AsyncBackend.call(on_started, process_id)
                elif event.type in {"stdout", "stderr"}:
                    handler = on_stdout if event.type == "stdout" else on_stderr
                    if handler is None:
                        output.keep(event)
                    else:
                        await AsyncBackend.call(handler, event.data)
                elif event.type == "exit":
                    return output.result(event, event.process_id or process_id)
        raise SpaceError("the exec stream ended before the command's exit", process_id=process_id)


class AsyncSnapshots:
    def __init__(self, sandbox: AsyncSandboxRef) -> None:
        self._sandbox = sandbox
        self._http = sandbox._http

    async def create(
        self, *, full: bool = False, name: str | None = None, idempotency_key: str | None = None
    ) -> Snapshot:
        """A disk snapshot, or with full=True a full checkpoint (processes and memory too). A full one may
        have a `name` (not unique: the newest of a name is the one `create(from_snapshot=name)` uses)."""
        body: dict[str, Any] = {"full": full}
        if name is not None:
            body["name"] = name
        answer = await self._http.json(
            "POST",
            f"{self._sandbox.path}/snapshots",
            json_body=body,
            idempotency_key=idempotency_key,
        )
        return Snapshot(answer)

    async def list(self) -> builtins.list[Snapshot]:
        answer = await self._http.json("GET", f"{self._sandbox.path}/snapshots")
        return [Snapshot(item) for item in answer.get("snapshots", [])]


class AsyncProjectSnapshots:
    """The project's full snapshots, by id or name, whatever sandbox took them: a named one outlives its
    sandbox (ADR 0060), so this is how it is listed and deleted after its sandbox is gone."""

    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def list(
        self, *, name: str | None = None, after: str | None = None, limit: int | None = None
    ) -> builtins.list[Snapshot]:
        """Ready full snapshots, oldest first; `name`: those of that name (or the one of that id)."""
        params = {k: v for k, v in {"name": name, "after": after, "limit": limit}.items() if v is not None}
        answer = await self._http.json("GET", "/v1/snapshots", params=params)
        return [Snapshot(item) for item in answer.get("snapshots", [])]

    async def delete(self, ref: str) -> builtins.list[str]:
        """Delete the snapshot of that id, or every snapshot of that name (NotFound: none); their ids."""
        answer = await self._http.json("DELETE", f"/v1/snapshots/{seg(ref)}")
        return [str(item) for item in answer.get("deleted", [])]
