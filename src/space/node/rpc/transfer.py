"""Suspend, upload, restore and recover over RPC: the node moves a sandbox to or from object storage.

Invariants:
- Each call is idempotent on the node: repeating `suspend` (same snapshot id) or `upload_snapshot` after a
  timeout returns the same result; `restore` of a sandbox that already runs there returns it as it is.
- A data key travels only in the request body: wrapped and plaintext (`suspend`, `upload_snapshot`, so the
  node can encrypt and record which key) or plaintext only (`restore`, so it can decrypt).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, Protocol

from space.core.settings import SandboxLimits
from space.node.agent import rpc_models as rm
from space.node.rpc.transport import NodeTransport, sandbox_path


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


class TransferCalls(NodeTransport):
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
        path = sandbox_path(sandbox_id, "suspend")
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
        path = sandbox_path(sandbox_id, "snapshots", snapshot_id, "upload")
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
            sandbox_path(sandbox_id, "recover"),
            json_body={"snapshot_id": snapshot_id},
            sandbox_id=sandbox_id,
        )
        return rm.SandboxObserved.model_validate(answer)
