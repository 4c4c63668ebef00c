"""An OCI build removes the image it was imported into (`<name>-oci`) once the build committed, and when it
gave up (space.node.agent.template_build, ADR 0056). The node's TemplateBuilds over the fake driver with a
scripted helper and import (the real import: test_template_travel_runsc; the helper's delete of `<name>`
taking `<name>-oci` with it: test_template_build_verbs)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

from space.core import errors
from space.node.agent import template_travel
from space.node.agent.agent import NodeAgent
from space.node.agent.service_core import ServiceCore
from space.node.agent.template_build import TemplateBuilds
from space.node.agent.template_build_sources import BuildSources
from space.node.drivers.fake import FakeDriver
from space.objectstore.backends import open_store

NAME = "tpl-0123456789abcdef"


class ScriptedHelper:
    """Answers the template verbs a build calls, recording each; a commit fails when told to."""

    def __init__(self, *, commit_fails: bool) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.commit_fails = commit_fails

    async def call(self, verb: str, params: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
        self.calls.append((verb, dict(params or {})))
        if verb == "template.list":
            imported = {"name": f"{NAME}-oci", "builtin": False, "metadata": {"from": "oci:x"}}
            return {"templates": [imported], "claims": [], "builtin_names": ["python", "base"]}
        if verb == "template.commit":
            if self.commit_fails:
                raise errors.RuntimeFailure("the snapshot failed")
            return {"name": NAME, "metadata": {"size_bytes": 1}}
        return {"name": (params or {}).get("name"), "previous": None, "existed": True}


def _build(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, *, commit_fails: bool) -> tuple[
    list[dict[str, Any]], list[tuple[str, dict[str, Any]]]
]:  # fmt: skip
    async def imported(agent: Any, name: str, ref: str | None) -> str:
        assert ref == "tpl_0123456789abcdef"
        return template_travel.imported_name(name)

    async def published(agent: Any, name: str) -> None:
        return None

    monkeypatch.setattr(template_travel, "import_oci", imported)
    monkeypatch.setattr(template_travel, "publish_template", published)
    helper = ScriptedHelper(commit_fails=commit_fails)
    driver = FakeDriver(tmp_path / "node")
    driver.helper = helper  # type: ignore[attr-defined]

    async def body() -> list[dict[str, Any]]:
        agent = NodeAgent(driver, store=open_store((tmp_path / "objects").as_uri()))
        await agent.prepare(templates=())
        builds = TemplateBuilds(ServiceCore(agent), BuildSources(apt_sources="", pip_index=None))
        try:
            run = await builds.begin(NAME, {"from": "oci:tpl_0123456789abcdef", "steps": [{"run": "true"}]})
            return [item async for item in builds.stream(run)]
        finally:
            await agent.delete_all()
            await agent.close()

    return asyncio.run(body()), helper.calls


def test_a_committed_oci_build_removes_its_imported_image(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items, calls = _build(tmp_path, monkeypatch, commit_fails=False)
    assert "done" in items[-1], items
    verbs = [verb for verb, _ in calls]
    commit = verbs.index("template.commit")
    assert calls[commit][1]["base"] == f"{NAME}-oci"  # the steps ran on the imported image
    assert ("template.delete", {"name": f"{NAME}-oci"}) in calls[commit:]
    assert ("template.delete", {"name": NAME}) not in calls  # the template itself stays


def test_a_failed_oci_build_removes_its_imported_image_too(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items, calls = _build(tmp_path, monkeypatch, commit_fails=True)
    assert items[-1]["error"]["code"] == "runtime_failure", items
    verbs = [verb for verb, _ in calls]
    commit = verbs.index("template.commit")
    assert ("template.delete", {"name": f"{NAME}-oci"}) in calls[commit:]
    assert calls[-1] == ("template.claim", {"name": NAME})  # and the claim dropped after it
