"""The organisation's resources: projects, API keys, the credentials the egress gateway injects, and (for
an organisation admin key) the cluster's nodes (docs/adr/0065-node-operations.md).

Invariants:
- A secret is shown once: an API key's `.key` only in the answer that created it; a credential's value
  never (it is write-only, and sandboxes see only its placeholder).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from space.sdk._async.http import AsyncHTTP
from space.sdk.models import ApiKey, Credential, Project, credential_body, seg
from space.sdk.node_models import Node

__all__ = ["AsyncCredentials", "AsyncKeys", "AsyncNodes", "AsyncProjects"]


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
        self, *, project: str, role: str = "member", e2b: bool = False, idempotency_key: str | None = None
    ) -> ApiKey:
        """A new API key for `project` (name or id); its secret `.key` is shown only in this answer. With
        `e2b`, the secret is in E2B's shape (`e2b_` + hex) for E2B SDKs that check it (docs/e2b.md)."""
        body = {"project": project, "role": role}
        if e2b:
            body["shape"] = "e2b"
        answer = await self._http.json("POST", "/v1/keys", json_body=body, idempotency_key=idempotency_key)
        return ApiKey(answer)

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
        login: Mapping[str, str | None] | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> Credential:
        """Create, update or rotate (a new `value`) a credential. `header` is e.g. 'Authorization: Bearer
        {value}'; or `method` "bearer" (default), "basic" (value 'user:password') or "query" (with
        `query_param`). `scope` is "project" (default), "org" (org admin keys) or "sandbox" (with
        `sandbox_id`); the most specific one of a name wins for a sandbox. A `login` credential (ADR 0063)
        takes `login` ({"origin": "https://host", "username_field", "password_field", "form_action"?}),
        `username` and `password` instead of value and hosts."""
        host_list = [hosts] if isinstance(hosts, str) else (list(hosts) if hosts is not None else None)
        body = credential_body(
            name, value=value, hosts=host_list, header=header, project=project, method=method,
            query_param=query_param, scope=scope, sandbox_id=sandbox_id, env_var=env_var,
            expires_at=expires_at, rate_per_minute=rate_per_minute,
        )  # fmt: skip
        extra = {"login": dict(login) if login else None, "username": username, "password": password}
        body.update({k: v for k, v in extra.items() if v is not None})
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


class AsyncNodes:
    """The cluster's nodes: an organisation admin key's view and the operator's hold on each."""

    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def list(self) -> builtins.list[Node]:
        answer = await self._http.json("GET", "/v1/cluster/nodes")
        return [Node(item) for item in answer.get("nodes", [])]

    async def get(self, node_id: str) -> Node:
        return Node(await self._http.json("GET", f"/v1/cluster/nodes/{seg(node_id)}"))

    async def cordon(self, node_id: str) -> Node:
        """No new sandbox is placed on the node; its sandboxes stay."""
        return Node(await self._http.json("POST", f"/v1/cluster/nodes/{seg(node_id)}/cordon"))

    async def uncordon(self, node_id: str) -> Node:
        return Node(await self._http.json("POST", f"/v1/cluster/nodes/{seg(node_id)}/uncordon"))

    async def drain(self, node_id: str) -> Node:
        """Cordon and move every sandbox off the node; poll `get` until `.admin == "drained"`."""
        return Node(await self._http.json("POST", f"/v1/cluster/nodes/{seg(node_id)}/drain"))

    async def remove(self, node_id: str) -> None:
        """Forget a drained (or empty, cordoned, lost or offline) node; its agent is refused after."""
        await self._http.json("DELETE", f"/v1/cluster/nodes/{seg(node_id)}")
