"""NodeClient: the control plane's (and gateway's) async client of one node agent's RPC.

Invariants:
- Every failure is a space.core error: an error answer is rebuilt with `errors.error_from_dict` (same code,
  message, details; e.g. InvalidState keeps `.state`), a node that cannot be reached is Unavailable, a
  request that runs out of time is Timeout, a stream that breaks off is Unavailable. Nothing else escapes.
- Streams are never buffered whole: file bodies go out from an async iterable and come back as an async
  iterator of chunks; NDJSON answers come back as an async iterator of dicts, and an error line at the end
  of a stream raises the typed error it carries.
- `proxy_stream` is for the gateway: it relays a request body and hands back the response body as an
  iterator of raw chunks, so a public request can be passed through without holding it in memory. Its node
  path is built here from the sandbox id and fixed or validated segments, each quoted as ONE segment.
- Every call scoped to a sandbox carries a capability for that sandbox (space.core.capability, keyed by
  this client's node token, DEFAULT_TTL_S), minted from the `sandbox_id` the caller passes explicitly (the
  id of the record it authorized), never from a path; the node refuses it for any other sandbox.
- The lifecycle calls are as idempotent as the node makes them (see space.node.agent.server): retrying one
  after a timeout or a crash is always safe; `fork` and `create_snapshot` take an idempotency key (or, for
  fork, the children's ids) to make their retries safe too.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from websockets.asyncio.client import connect as ws_connect

from space.core import errors
from space.core.capability import CAPABILITY_HEADER, mint
from space.core.ids import parse_sandbox_id
from space.core.settings import SandboxLimits
from space.node.agent import rpc_models as rm
from space.node.agent.guest import command_params

API_PREFIX = "/node/v1"
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
# Streams (exec, attach, watch, file bodies) may legitimately stay quiet or last for hours.
STREAM_TIMEOUT = httpx.Timeout(None, connect=10.0)

Body = bytes | AsyncIterable[bytes]


def _seg(value: str) -> str:
    """One path segment: ids are validated by the node, but nothing here may add a '/' or a '?'."""
    return quote(value, safe="")


def _sandbox_path(sandbox_id: str, *segments: str) -> str:
    """`/sandboxes/<id>/<segment>...`, every piece quoted as one segment (no '/', '?', '%' or dot segment
    can change which route or sandbox the node sees)."""
    pieces = [parse_sandbox_id(sandbox_id), *segments]
    if any(piece in {"", ".", ".."} for piece in pieces):
        raise errors.InvalidArgument("a node path segment may not be empty, '.' or '..'", field="path")
    return "/sandboxes/" + "/".join(_seg(piece) for piece in pieces)


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as exc:
        raise errors.Timeout(f"node RPC {what} timed out: {exc}") from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise errors.Unavailable(f"node RPC {what} failed: {exc!r}") from exc


def error_from_response(status: int, body: bytes) -> errors.SpaceError:
    """The typed error of a node's error answer (or a best guess when the body is not ours)."""
    try:
        payload = json.loads(body)
        error = payload["error"]
        if isinstance(error, dict) and "code" in error:
            return errors.error_from_dict(error)
    except (ValueError, KeyError, TypeError):
        pass
    text = body[:300].decode("utf-8", "replace")
    if status in {502, 503, 504}:
        return errors.Unavailable(f"node answered {status}: {text}")
    return errors.Internal(f"node answered {status} without an error body: {text}")


async def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise error_from_response(response.status_code, await response.aread())


@dataclass
class ProxiedResponse:
    """An open node response for the gateway to relay: iterate `body()` (which closes it at the end) or
    call `aclose()`; e.g. `StreamingResponse(p.body(), p.status_code, media_type=p.media_type)`."""

    response: httpx.Response

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    @property
    def media_type(self) -> str | None:
        value: str | None = self.response.headers.get("content-type")
        return value

    async def body(self) -> AsyncIterator[bytes]:
        try:
            with _translated("relay"):
                async for chunk in self.response.aiter_raw():
                    yield chunk
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        await self.response.aclose()


class NodeClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._http = httpx.AsyncClient(
            base_url=self.base_url + API_PREFIX,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    # -- plumbing --------------------------------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        content: Body | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        sandbox_id: str | None = None,
    ) -> Any:
        with _translated(f"{method} {path}"):
            kwargs: dict[str, Any] = {
                "params": _params(params),
                "headers": self._headers(headers, sandbox_id),
            }
            if json_body is not None:
                kwargs["json"] = json_body
            if content is not None:
                kwargs["content"] = content
            if timeout is not None:
                kwargs["timeout"] = timeout
            response = await self._http.request(method, path, **kwargs)
            await _raise_for_error(response)
            if response.status_code == 204 or not response.content:
                return {}
            return response.json()

    async def _lines(
        self,
        method: str,
        path: str,
        *,
        sandbox_id: str,
        params: Mapping[str, Any] | None = None,
        json_body: Any = None,
    ) -> AsyncIterator[dict[str, Any]]:
        with _translated(f"{method} {path}"):
            async with self._http.stream(
                method, path, params=_params(params), json=json_body, timeout=STREAM_TIMEOUT,
                headers=self._headers(None, sandbox_id),
            ) as response:  # fmt: skip
                await _raise_for_error(response)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if item.get("type") == "error" and isinstance(item.get("error"), dict):
                        raise errors.error_from_dict(item["error"])
                    yield item

    def capability(self, sandbox_id: str) -> dict[str, str]:
        """The header that lets one call act on `sandbox_id` (and on no other sandbox) on this node."""
        return {CAPABILITY_HEADER: mint(self._token, sandbox_id, now=time.time())}

    def _headers(self, headers: Mapping[str, str] | None, sandbox_id: str | None) -> dict[str, str]:
        merged = {k: v for k, v in (headers or {}).items() if k.lower() != CAPABILITY_HEADER.lower()}
        if sandbox_id is not None:
            merged.update(self.capability(sandbox_id))
        return merged

    # -- node ------------------------------------------------------------------------------------------------
    async def info(self) -> rm.NodeInfo:
        return rm.NodeInfo.model_validate(await self._request("GET", "/info"))

    async def list_sandboxes(self, *, guest: bool = True) -> rm.SandboxList:
        answer = await self._request("GET", "/sandboxes", params={"guest": guest})
        return rm.SandboxList.model_validate(answer)

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def get_sandbox(self, sandbox_id: str) -> rm.SandboxObserved:
        return rm.SandboxObserved.model_validate(
            await self._request("GET", _sandbox_path(sandbox_id), sandbox_id=sandbox_id)
        )

    async def create_sandbox(
        self,
        sandbox_id: str,
        *,
        template: str = "python",
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | Mapping[str, Any] | None = None,
        egress: Mapping[str, Any] | None = None,
    ) -> tuple[rm.SandboxObserved, bool]:
        """Create the sandbox with this id, or get it as it is if it exists; (observed, created). `egress`
        ({"allow", "deny", "credentials", "version"}): its policy; without it a node with a control plane
        asks the control plane for it, and no policy means no egress."""
        body: dict[str, Any] = {"template": template, "env": dict(env or {})}
        if limits is not None:
            body["limits"] = limits.model_dump() if isinstance(limits, SandboxLimits) else dict(limits)
        if egress is not None:
            body["egress"] = dict(egress)
        path = _sandbox_path(sandbox_id)
        with _translated(f"PUT {path}"):
            response = await self._http.put(path, json=body, headers=self._headers(None, sandbox_id))
            await _raise_for_error(response)
        return rm.SandboxObserved.model_validate(response.json()), response.status_code == 201

    async def action(self, sandbox_id: str, action: rm.LifecycleAction) -> rm.SandboxObserved:
        answer = await self._request("POST", _sandbox_path(sandbox_id, action), sandbox_id=sandbox_id)
        return rm.SandboxObserved.model_validate(answer)

    async def pause(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "pause")

    async def resume(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "resume")

    async def stop(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "stop")

    async def start(self, sandbox_id: str) -> rm.SandboxObserved:
        return await self.action(sandbox_id, "start")

    async def delete_sandbox(self, sandbox_id: str) -> rm.DeleteResult:
        return rm.DeleteResult.model_validate(
            await self._request("DELETE", _sandbox_path(sandbox_id), sandbox_id=sandbox_id)
        )

    async def create_snapshot(
        self, sandbox_id: str, *, full: bool = False, idempotency_key: str | None = None
    ) -> rm.SnapshotInfo:
        answer = await self._request(
            "POST", _sandbox_path(sandbox_id, "snapshots"), json_body={"full": full},
            headers=_idempotency(idempotency_key), sandbox_id=sandbox_id,
        )  # fmt: skip
        return rm.SnapshotInfo.model_validate(answer)

    async def list_snapshots(self, sandbox_id: str) -> list[rm.SnapshotInfo]:
        answer = await self._request("GET", _sandbox_path(sandbox_id, "snapshots"), sandbox_id=sandbox_id)
        return rm.SnapshotList.model_validate(answer).snapshots

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        path = _sandbox_path(sandbox_id, "snapshots", snapshot_id)
        await self._request("DELETE", path, sandbox_id=sandbox_id)

    async def set_egress(
        self, sandbox_id: str, policy: Mapping[str, Any], credentials: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Apply a changed egress policy ({"allow", "deny", "version"}) and the names of the credentials now
        bound to the sandbox (their values the node fetches from the control plane itself)."""
        body = {"policy": dict(policy), "credentials": list(credentials)}
        path = _sandbox_path(sandbox_id, "egress")
        answer = await self._request("PUT", path, json_body=body, sandbox_id=sandbox_id)
        return dict(answer)

    async def rollback(self, sandbox_id: str, snapshot_id: str) -> rm.SandboxObserved:
        answer = await self._request(
            "POST",
            _sandbox_path(sandbox_id, "rollback"),
            json_body={"snapshot_id": snapshot_id},
            sandbox_id=sandbox_id,
        )
        return rm.SandboxObserved.model_validate(answer)

    async def fork(
        self,
        sandbox_id: str,
        *,
        count: int = 1,
        snapshot_id: str | None = None,
        child_ids: Sequence[str] | None = None,
        idempotency_key: str | None = None,
    ) -> list[rm.SandboxObserved]:
        body: dict[str, Any] = {"count": count}
        if snapshot_id is not None:
            body["snapshot_id"] = snapshot_id
        if child_ids is not None:
            body["child_ids"] = list(child_ids)
        answer = await self._request(
            "POST",
            _sandbox_path(sandbox_id, "fork"),
            json_body=body,
            headers=_idempotency(idempotency_key),
            sandbox_id=sandbox_id,
        )
        return rm.SandboxList.model_validate(answer).sandboxes

    # -- suspend / restore / recover (object storage) -------------------------------------------------------
    async def suspend(
        self,
        sandbox_id: str,
        *,
        store_url: str,
        prefix: str,
        snapshot_id: str,
        data_key: DataKeyLike | None = None,
    ) -> rm.TransferResult:
        """pause -> full checkpoint -> upload (manifest last) on the node; the sandbox stays there, paused,
        until `delete_sandbox`. Repeating it (same snapshot id) after a timeout returns the same result."""
        body = {"store_url": store_url, "prefix": prefix, "snapshot_id": snapshot_id,
                "data_key": _data_key_body(data_key)}  # fmt: skip
        path = _sandbox_path(sandbox_id, "suspend")
        answer = await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)
        return rm.TransferResult.model_validate(answer)

    async def upload_snapshot(
        self,
        sandbox_id: str,
        snapshot_id: str,
        *,
        store_url: str,
        prefix: str,
        data_key: DataKeyLike | None = None,
    ) -> rm.TransferResult:
        body = {"store_url": store_url, "prefix": prefix, "data_key": _data_key_body(data_key)}
        path = _sandbox_path(sandbox_id, "snapshots", snapshot_id, "upload")
        answer = await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)
        return rm.TransferResult.model_validate(answer)

    async def restore(
        self,
        sandbox_id: str,
        *,
        store_url: str,
        prefix: str,
        data_key: bytes | None = None,
        template: str = "python",
        limits: SandboxLimits | Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        egress: Mapping[str, Any] | None = None,
    ) -> rm.SandboxObserved:
        """Run a suspended sandbox on this node from its artifact (download, verify, import, restore);
        idempotent: a sandbox that already runs there is returned as it is. `egress`: as on create."""
        body: dict[str, Any] = {
            "sandbox_id": sandbox_id, "store_url": store_url, "prefix": prefix,
            "data_key_b64": base64.b64encode(data_key).decode() if data_key is not None else None,
            "template": template, "env": dict(env or {}),
        }  # fmt: skip
        if limits is not None:
            body["limits"] = limits.model_dump() if isinstance(limits, SandboxLimits) else dict(limits)
        if egress is not None:
            body["egress"] = dict(egress)
        answer = await self._request("POST", "/sandboxes/restore", json_body=body, sandbox_id=sandbox_id)
        return rm.SandboxObserved.model_validate(answer)

    async def recover(self, sandbox_id: str, *, snapshot_id: str | None = None) -> rm.SandboxObserved:
        """crashed -> recovering -> running from the node's newest (or the named) full checkpoint."""
        answer = await self._request(
            "POST",
            _sandbox_path(sandbox_id, "recover"),
            json_body={"snapshot_id": snapshot_id},
            sandbox_id=sandbox_id,
        )
        return rm.SandboxObserved.model_validate(answer)

    # -- data plane: processes -------------------------------------------------------------------------------
    async def exec(
        self,
        sandbox_id: str,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> rm.ExecResponse:
        body = command_params(command, env, cwd, user, timeout) | _stdin(stdin)
        answer = await self._request(
            "POST",
            _sandbox_path(sandbox_id, "exec"),
            json_body=body,
            timeout=STREAM_TIMEOUT,
            sandbox_id=sandbox_id,
        )
        return rm.ExecResponse.model_validate(answer)

    async def exec_stream(
        self,
        sandbox_id: str,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: started, stdout/stderr (data_b64), then exit."""
        body = command_params(command, env, cwd, user, timeout) | _stdin(stdin) | {"stream": True}
        path = _sandbox_path(sandbox_id, "exec")
        async for item in self._lines("POST", path, json_body=body, sandbox_id=sandbox_id):
            yield item

    async def start_process(
        self,
        sandbox_id: str,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        tag: str | None = None,
        pty: tuple[int, int] | None = None,
        stdin: bool = False,
    ) -> rm.ProcessStarted:
        body = command_params(command, env, cwd, user, timeout) | {"stdin": stdin}
        if tag is not None:
            body["tag"] = tag
        if pty is not None:
            body["pty"] = {"rows": pty[0], "cols": pty[1]}
        path = _sandbox_path(sandbox_id, "processes")
        answer = await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)
        return rm.ProcessStarted.model_validate(answer)

    async def list_processes(self, sandbox_id: str) -> list[dict[str, Any]]:
        answer = await self._request("GET", _sandbox_path(sandbox_id, "processes"), sandbox_id=sandbox_id)
        return rm.ProcessList.model_validate(answer).processes

    async def attach(
        self, sandbox_id: str, process_id: str, *, offset: int = 0, follow: bool = True
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: attached {offset, truncated}, stdout/stderr, then exit (end if not following)."""
        path = _sandbox_path(sandbox_id, "processes", process_id, "output")
        params = {"offset": offset, "follow": follow}
        async for item in self._lines("GET", path, params=params, sandbox_id=sandbox_id):
            yield item

    async def write_stdin(self, sandbox_id: str, process_id: str, data: Body, *, eof: bool = False) -> int:
        path = _sandbox_path(sandbox_id, "processes", process_id, "stdin")
        answer = await self._request(
            "POST", path, params={"eof": eof}, content=data, timeout=STREAM_TIMEOUT, sandbox_id=sandbox_id
        )
        return int(answer["written"])

    async def signal(self, sandbox_id: str, process_id: str, signal: str | int = "SIGTERM") -> None:
        path = _sandbox_path(sandbox_id, "processes", process_id, "signal")
        await self._request("POST", path, json_body={"signal": signal}, sandbox_id=sandbox_id)

    async def resize(self, sandbox_id: str, process_id: str, rows: int, cols: int) -> None:
        path = _sandbox_path(sandbox_id, "processes", process_id, "resize")
        await self._request("POST", path, json_body={"rows": rows, "cols": cols}, sandbox_id=sandbox_id)

    def pty(self, sandbox_id: str, *, rows: int = 24, cols: int = 80, cmd: str = "/bin/bash") -> ws_connect:
        """`async with client.pty(id) as ws:` — send bytes (input) or {"resize": [rows, cols]} as text;
        receive bytes (output) and text events ({"type": "started"|"exit"|"error", ...})."""
        base = self.base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        query = httpx.QueryParams({"rows": rows, "cols": cols, "cmd": cmd})
        return ws_connect(
            f"{base}{API_PREFIX}{_sandbox_path(sandbox_id, 'pty')}?{query}",
            additional_headers={"Authorization": f"Bearer {self._token}", **self.capability(sandbox_id)},
            max_size=None,
        )

    # -- data plane: files -----------------------------------------------------------------------------------
    async def write_file(
        self, sandbox_id: str, path: str, data: Body, *, mode: int | None = None, append: bool = False
    ) -> int:
        params: dict[str, Any] = {"path": path, "append": append}
        if mode is not None:
            params["mode"] = mode
        answer = await self._request(
            "PUT", _sandbox_path(sandbox_id, "files"), params=params, content=data,
            headers={"Content-Type": "application/octet-stream"}, timeout=STREAM_TIMEOUT,
            sandbox_id=sandbox_id,
        )  # fmt: skip
        return int(answer["size"])

    async def read_file_stream(
        self, sandbox_id: str, path: str, *, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes]:
        params: dict[str, Any] = {"path": path, "offset": offset}
        if length is not None:
            params["length"] = length
        url = _sandbox_path(sandbox_id, "files")
        headers = self._headers(None, sandbox_id)
        with _translated(f"GET {url}"):
            async with self._http.stream(
                "GET", url, params=params, timeout=STREAM_TIMEOUT, headers=headers
            ) as response:
                await _raise_for_error(response)
                async for chunk in response.aiter_raw():
                    yield chunk

    async def read_file(
        self, sandbox_id: str, path: str, *, offset: int = 0, length: int | None = None
    ) -> bytes:
        buf = bytearray()
        async for chunk in self.read_file_stream(sandbox_id, path, offset=offset, length=length):
            buf.extend(chunk)
        return bytes(buf)

    async def list_files(self, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        answer = await self._request(
            "GET", _sandbox_path(sandbox_id, "files", "list"), params={"path": path}, sandbox_id=sandbox_id
        )
        return rm.FileList.model_validate(answer).entries

    async def stat(self, sandbox_id: str, path: str) -> dict[str, Any]:
        answer: dict[str, Any] = await self._request(
            "GET", _sandbox_path(sandbox_id, "files", "stat"), params={"path": path}, sandbox_id=sandbox_id
        )
        return answer

    async def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        body = {"path": path, "parents": parents, "mode": mode}
        path_ = _sandbox_path(sandbox_id, "files", "mkdir")
        await self._request("POST", path_, json_body=body, sandbox_id=sandbox_id)

    async def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": recursive}
        await self._request(
            "DELETE", _sandbox_path(sandbox_id, "files"), params=params, sandbox_id=sandbox_id
        )

    async def rename(self, sandbox_id: str, src: str, dst: str) -> None:
        body = {"src": src, "dst": dst}
        path = _sandbox_path(sandbox_id, "files", "rename")
        await self._request("POST", path, json_body=body, sandbox_id=sandbox_id)

    async def watch(
        self, sandbox_id: str, path: str, *, recursive: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """NDJSON events: {"type": "watching"} once the watch is in place, then {"type": "changes"}."""
        params = {"path": path, "recursive": recursive}
        url = _sandbox_path(sandbox_id, "files", "watch")
        async for item in self._lines("GET", url, params=params, sandbox_id=sandbox_id):
            yield item

    # -- gateway relay ---------------------------------------------------------------------------------------
    async def proxy_stream(
        self,
        method: str,
        sandbox_id: str,
        *segments: str,
        params: Mapping[str, Any] | None = None,
        content: Body | None = None,
        headers: Mapping[str, str] | None = None,
        raise_errors: bool = True,
    ) -> ProxiedResponse:
        """Send `method /sandboxes/<sandbox_id>/<segments...>` (under /node/v1; each segment quoted as one, so
        pass fixed route words and validated ids only) with `content` streamed from an async iterable (e.g.
        a Starlette `request.stream()`), carrying a capability for `sandbox_id`; return the open response
        for relaying. With `raise_errors`, an error answer is read (it is small) and raised as its typed
        error."""
        path = _sandbox_path(sandbox_id, *segments)
        request = self._http.build_request(
            method, path, params=_params(params), content=content,
            headers=self._headers(headers, sandbox_id), timeout=STREAM_TIMEOUT,
        )  # fmt: skip
        with _translated(f"{method} {path}"):
            response = await self._http.send(request, stream=True)
            if raise_errors and response.status_code >= 400:
                try:
                    await _raise_for_error(response)
                finally:
                    await response.aclose()
        return ProxiedResponse(response)


class DataKeyLike(Protocol):
    """space.crypto.envelope.DataKey (or anything shaped like it)."""

    @property
    def key_id(self) -> str: ...
    @property
    def wrapped(self) -> bytes: ...
    @property
    def plaintext(self) -> bytes: ...


def _data_key_body(key: DataKeyLike | None) -> dict[str, str] | None:
    if key is None:
        return None
    return {
        "key_id": key.key_id,
        "wrapped_b64": base64.b64encode(key.wrapped).decode(),
        "plaintext_b64": base64.b64encode(key.plaintext).decode(),
    }


def _params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Query values as the server parses them (booleans as true/false, not Python's True/False)."""
    if params is None:
        return None
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in params.items() if v is not None}


def _idempotency(key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": key} if key is not None else {}


def _stdin(stdin: bytes | None) -> dict[str, Any]:
    return {} if stdin is None else {"stdin_b64": base64.b64encode(stdin).decode()}
