"""Templates in the SDK, without I/O: the Template record, the build spec made from options, and the one
error a failed build raises (docs/api.md#templates, ADR 0055).

Invariants:
- `build_spec` makes exactly the JSON the API takes (`space.core.template_spec`'s shape); it checks only
  what the options themselves can get wrong (a K=V without `=`); the server validates the rest.
- Steps keep the order of the options' kinds the CLI documents: files, apt, pip, env, workdir, run (a
  declarative file gives its own order).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

from space.core.errors import InvalidArgument, SpaceError
from space.sdk.models import Record

__all__ = ["OCI_UPLOAD", "Template", "TemplateBuildFailed", "build_spec", "parse_env"]

#: `from` of a build whose OCI archive is uploaded after the template is recorded.
OCI_UPLOAD = "oci:upload"


class TemplateBuildFailed(SpaceError):
    """The build ended `failed`; `.template` is the template as it ended, its `error` the reason."""

    code = "build_failed"

    def __init__(self, template: Template) -> None:
        super().__init__(
            f"template {template.name!r} failed to build: {template.error}", template_id=template.id
        )
        self.template = template


class Template(Record):
    @property
    def name(self) -> str:
        return str(self.data.get("name", ""))

    @property
    def status(self) -> str:
        return str(self.data.get("status", ""))

    @property
    def error(self) -> str | None:
        value = self.data.get("error")
        return None if value is None else str(value)


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"expected K=V, got {pair[:40]!r}", field="env")
        env[key] = value
    return env


def build_spec(
    from_: str,
    *,
    files: Mapping[str, bytes] | None = None,
    apt: Sequence[str] = (),
    pip: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    run: Sequence[str] = (),
    user: str | None = None,
    start_cmd: str | None = None,
    file_mode: int = 0o644,
) -> dict[str, Any]:
    """A build spec from options: `files` maps a path in the template to its content."""
    steps: list[dict[str, Any]] = [
        {"file": {"path": path, "content_b64": base64.b64encode(content).decode(), "mode": file_mode}}
        for path, content in (files or {}).items()
    ]
    if apt:
        steps.append({"apt": list(apt)})
    if pip:
        steps.append({"pip": list(pip)})
    if env:
        steps.append({"env": dict(env)})
    if workdir:
        steps.append({"workdir": workdir})
    steps += [{"run": command} for command in run]
    return {"from": from_, "steps": steps, "user": user, "start_cmd": start_cmd}
