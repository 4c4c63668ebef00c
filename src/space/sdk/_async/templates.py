"""A project's templates: build (and wait), list, get, follow the build log, delete (ADR 0055).

Invariants:
- `build` returns only a READY template; a build that ends failed raises TemplateBuildFailed with the
  reason, and every refusal of the request is the API's typed error.
- The build log is read as the server streams it (NDJSON), never whole; `on_log` sees each line once.
- An OCI archive (`source`) is sent as a stream after the template is recorded with `from` OCI_UPLOAD.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from space.sdk._async.http import AsyncHTTP
from space.sdk.models import seg
from space.sdk.template_models import OCI_UPLOAD, Template, TemplateBuildFailed

__all__ = ["AsyncTemplates"]

SOURCE_CHUNK = 1 << 20


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(SOURCE_CHUNK):
            yield chunk


class AsyncTemplates:
    def __init__(self, http: AsyncHTTP) -> None:
        self._http = http

    async def start_build(
        self, name: str, spec: dict[str, Any], *, source: str | Path | None = None
    ) -> Template:
        """Record the build and return at once (status `building`); with `source`, an OCI archive file
        (`docker save` or OCI layout tarball) is uploaded for it first."""
        body = {"name": name, "spec": {**spec, "from": OCI_UPLOAD} if source is not None else spec}
        made = Template(await self._http.json("POST", "/v1/templates", json_body=body))
        if source is not None:
            answer = await self._http.json(
                "PUT", f"/v1/templates/{seg(made.id)}/source", content=_file_chunks(Path(source)),
                headers={"Content-Type": "application/octet-stream"}, timeout=self._http.timeout(None),
            )  # fmt: skip
            made = Template(answer)
        return made

    async def build(
        self,
        name: str,
        spec: dict[str, Any],
        *,
        source: str | Path | None = None,
        on_log: Callable[[str], None] | None = None,
    ) -> Template:
        """Build template `name` from `spec` and wait: the ready template, or TemplateBuildFailed."""
        made = await self.start_build(name, spec, source=source)
        final = made
        async for item in self.logs(made.id, follow=True):
            if "log" in item and on_log is not None:
                on_log(str(item["log"]))
            elif "template" in item and item["template"] is not None:
                final = Template(item["template"])
        if final.status != "ready":
            raise TemplateBuildFailed(final)
        return final

    async def logs(
        self, template: str, *, follow: bool = False, after: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """The build log: `{"log", "seq", "at"}` items, then one `{"template": ...}` (with `follow`, once the
        build ended)."""
        async with self._http.stream(
            "GET", f"/v1/templates/{seg(template)}/logs", params={"follow": follow, "after": after},
            timeout=self._http.timeout(None),
        ) as response:  # fmt: skip
            async for item in self._http.iter_ndjson(response):
                yield item

    async def list(self) -> builtins.list[Template]:
        answer = await self._http.json("GET", "/v1/templates")
        return [Template(item) for item in answer.get("templates", [])]

    async def get(self, template: str) -> Template:
        """A template by id or name (the project's own, or a built-in)."""
        return Template(await self._http.json("GET", f"/v1/templates/{seg(template)}"))

    async def delete(self, template: str) -> None:
        await self._http.json("DELETE", f"/v1/templates/{seg(template)}")
