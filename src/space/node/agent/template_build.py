"""User templates on this node: build one in a sandbox and commit it, delete one, list what the node holds
(docs/adr/0054-template-build.md). The routes are space.node.agent.routes.templates.

A build: a build sandbox is made from `from` (cold, never pooled), its egress allowing exactly the package
sources' hosts; the steps run in it as root (space.node.agent.template_build_steps); it is stopped and its
root filesystem committed read-only as `templates/<name>` with metadata written last (helper verb
template.commit); it is destroyed; the template gets its warm start; it is published to the object store
when the node has one.

Invariants:
- One build per name at a time on this node, and none of a name the node holds (AlreadyExists) or of a
  built-in (InvalidArgument); a delete of a name being built is InvalidState "building" (409).
- Before the build sandbox exists its id is claimed with the helper; a build that fails or is cancelled
  destroys its sandbox and drops the claim (shielded from the cancel), so nothing half-built stays. A build
  killed with its agent is cleaned up by the next sweep (every build, delete and listing sweeps): each claim
  no running build owns has its sandbox destroyed, its staging and incomplete tree discarded.
- Errors of the request itself (name, spec, base, conflicts) are raised before the stream starts, so they
  are plain HTTP errors; after that, a failure is the stream's last item `{"error": {...}}`, a success
  `{"done": {"name", "size_bytes", "metadata"}}`.
- The node's template list (info, heartbeat) gains a template when its build is done and loses it when it
  is deleted.
- An OCI build's imported image (template `<name>-oci`) is deleted once the build committed or gave up; the
  build sandbox never runs its base's start command (space.node.agent.template_start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import anyio

from space.core import errors
from space.core.ids import new_sandbox_id, parse_template_name
from space.core.template_spec import TemplateBuildSpec, parse_build_spec
from space.node.agent import template_travel
from space.node.agent.egress_settings import EgressRequest
from space.node.agent.service_core import ServiceCore
from space.node.agent.template_build_sources import BuildSources, machine_sources
from space.node.agent.template_build_steps import LogSink, StepRunner, run_steps

if TYPE_CHECKING:
    from space.node.agent.helper_client import HelperClient

log = logging.getLogger(__name__)

#: Helper calls that copy or walk a whole tree (commit) may take this long.
COMMIT_TIMEOUT_S = 900.0


@dataclass
class BuildRun:
    name: str
    spec: TemplateBuildSpec
    base: str | None  # None: an OCI archive, imported as a template of its own first (ADR 0056)


class TemplateBuilds:
    """The node's user templates (see the module docstring), over one node service."""

    def __init__(self, svc: ServiceCore, sources: BuildSources | None = None) -> None:
        self.svc = svc
        self._sources = sources
        #: name -> the build sandbox's id ("" while the build is being set up).
        self.building: dict[str, str] = {}
        #: The built-in template names (the helper's table, learnt from every listing).
        self.builtin_names: frozenset[str] = frozenset({"python", "base"})

    def use_sources(self, sources: BuildSources) -> None:
        """Build from these sources instead of the machine's (an operator's mirror; tests)."""
        self._sources = sources

    async def sources(self) -> BuildSources:
        """This node's build sources (read from the machine's configuration at the first build)."""
        if self._sources is None:
            self._sources = await machine_sources(self._helper())
        return self._sources

    def _helper(self) -> HelperClient:
        helper = getattr(self.svc.agent.driver, "helper", None)
        if helper is None:
            raise errors.Unavailable("this node's driver cannot build templates (no helper)")
        return cast("HelperClient", helper)

    # -- listing and sweeping ----------------------------------------------------------------------------
    async def held(self) -> list[dict[str, Any]]:
        """The complete templates on this node (built-in and user), after a sweep."""
        listing = await self.sweep()
        self.builtin_names = frozenset(str(n) for n in listing.get("builtin_names", ()))
        templates = [dict(t) for t in listing["templates"]]
        for entry in templates:
            if entry["name"] not in self.svc.templates:
                self.svc.templates.append(entry["name"])
        return templates

    async def sweep(self) -> dict[str, Any]:
        """Destroy what builds killed with an earlier agent left (see the module invariants)."""
        helper = self._helper()
        listing = await helper.call("template.list")
        for claim in listing.get("claims", []):
            name, sandbox_id = str(claim["name"]), str(claim["sandbox_id"])
            if name in self.building:
                continue
            log.info("template %s: cleaning up after a build that did not finish (%s)", name, sandbox_id)
            await self._destroy(sandbox_id)
            await helper.call("template.claim", {"name": name})
        return listing

    async def _destroy(self, sandbox_id: str) -> None:
        agent = self.svc.agent
        if sandbox_id in agent.sandboxes:
            try:
                await agent.delete(sandbox_id)
                return
            except (errors.InvalidState, errors.NotFound) as exc:
                log.warning("build sandbox %s not deleted (%s): destroying it", sandbox_id, exc.message)
                agent.sandboxes.pop(sandbox_id, None)
        await agent.driver.destroy(sandbox_id)

    # -- build -------------------------------------------------------------------------------------------
    async def begin(self, name: str, data: Any) -> BuildRun:
        """Check a build request and reserve its name; raises before anything is made."""
        name = parse_template_name(name, field="name")
        if name in self.builtin_names:
            raise errors.InvalidArgument(f"{name!r} is a built-in template", field="name")
        spec = parse_build_spec(data)
        if name in self.building:
            raise errors.InvalidState(f"template {name!r} is being built", state="building")
        self.building[name] = ""
        try:
            names = {t["name"] for t in await self.held()}
            if name in self.builtin_names:
                raise errors.InvalidArgument(f"{name!r} is a built-in template", field="name")
            if name in names:
                raise errors.AlreadyExists(f"template {name!r} is already on this node", name=name)
            base = await self._base(name, spec, names)
        except BaseException:
            self.building.pop(name, None)
            raise
        return BuildRun(name, spec, base)

    async def _base(self, name: str, spec: TemplateBuildSpec, names: set[str]) -> str | None:
        """The template the build sandbox is made from; None for an OCI archive (imported in the build)."""
        base = spec.base_template
        if base is not None and base not in names:
            raise errors.NotFound(f"template {base!r} is not on this node", template=base)
        if base is None and self.svc.agent.store is None:
            raise errors.InvalidArgument("this node has no object store to read an OCI archive from")
        return base

    async def stream(self, run: BuildRun) -> AsyncGenerator[dict[str, Any], None]:
        """The build's items (see the module invariants); a consumer that goes away cancels the build."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._run(run, queue))
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            if not task.done():
                task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, run: BuildRun, queue: asyncio.Queue[dict[str, Any] | None]) -> None:
        sink = LogSink(lambda line: queue.put_nowait({"log": line}))
        try:
            done = await self._build(run, sink)
            queue.put_nowait({"done": done})
        except errors.SpaceError as exc:
            queue.put_nowait({"error": exc.to_dict()})
        except Exception as exc:  # reported as the stream's last item, logged with its trace
            log.exception("template %s: build failed", run.name)
            queue.put_nowait({"error": errors.Internal(f"build failed: {type(exc).__name__}").to_dict()})
        finally:
            self.building.pop(run.name, None)
            queue.put_nowait(None)

    async def _build(self, run: BuildRun, sink: LogSink) -> dict[str, Any]:
        helper, agent, sources = self._helper(), self.svc.agent, await self.sources()
        sandbox_id = new_sandbox_id()
        self.building[run.name] = sandbox_id
        claim = await helper.call("template.claim", {"name": run.name, "sandbox_id": sandbox_id})
        if claim.get("previous"):
            await self._destroy(str(claim["previous"]))
        egress = self.svc.egress
        try:
            if run.base is None:
                sink.note("importing the OCI archive")
                run.base = await template_travel.import_oci(agent, run.name, run.spec.oci_ref)
            if egress is not None:
                egress.remember(sandbox_id, EgressRequest(allow=sources.allow_hosts()))
            sink.note(f"build sandbox {sandbox_id} from template {run.base}")
            handle = await agent.create(
                run.base, limits=sources.limits, sandbox_id=sandbox_id, warm=False, start=False
            )  # the base's start command must not run into the committed tree
            await run_steps(StepRunner(handle.session, run.spec, sources, sink), egress=egress is not None)
            sink.note("committing the root filesystem")
            await agent.stop(sandbox_id)
            result = await helper.call("template.commit", self._commit_params(run, sandbox_id),
                                       timeout=COMMIT_TIMEOUT_S)  # fmt: skip
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._give_up(run, sandbox_id)
            raise
        sink.note("committed; destroying the build sandbox")
        await self._destroy(sandbox_id)
        if run.spec.oci_ref is not None:
            sink.note("removing the imported image")
            await self._drop_imported(run.name)
        await self._after_commit(run.name, sink)
        sink.note("ready")
        meta = result["metadata"]
        return {"name": run.name, "size_bytes": meta.get("size_bytes"), "metadata": meta}

    def _commit_params(self, run: BuildRun, sandbox_id: str) -> dict[str, Any]:
        spec = run.spec
        params: dict[str, Any] = {
            "name": run.name, "sandbox_id": sandbox_id, "base": run.base, "spec_hash": spec.spec_hash(),
            "env": spec.final_env(),
        }  # fmt: skip
        # `root` is passed as such: the helper drops it, and the base's default user with it.
        optional = {"default_user": spec.user, "workdir": spec.final_workdir(), "start_cmd": spec.start_cmd}
        params.update({k: v for k, v in optional.items() if v is not None})
        return params

    async def _give_up(self, run: BuildRun, sandbox_id: str) -> None:
        try:
            await self._destroy(sandbox_id)
            if run.spec.oci_ref is not None:
                await self._drop_imported(run.name)
            await self._helper().call("template.claim", {"name": run.name})
        except errors.SpaceError as exc:  # the next sweep finishes it: the claim is still there
            log.warning("template %s: clean-up after a failed build incomplete: %s", run.name, exc.message)

    async def _drop_imported(self, name: str) -> None:
        """The template an OCI build of `name` ran on (its image, unpacked): not needed once `name` is
        committed or given up (template.delete of `name` removes it too, for a build killed between)."""
        await self._helper().call("template.delete", {"name": template_travel.imported_name(name)})

    async def _after_commit(self, name: str, sink: LogSink) -> None:
        """The warm start and the publication: the template works without either, so failures are logged."""
        sink.note("preparing the warm start")
        try:
            await self.svc.agent.ensure_warm(name)
        except errors.SpaceError as exc:
            sink.note(f"no warm start ({exc.message}); sandboxes of it boot cold")
        if self.svc.agent.store is not None:
            sink.note("publishing to the object store")
            try:
                await template_travel.publish_template(self.svc.agent, name)
            except errors.SpaceError as exc:
                sink.note(f"not published ({exc.message})")
        if name not in self.svc.templates:
            self.svc.templates.append(name)

    # -- delete --------------------------------------------------------------------------------------------
    async def delete(self, name: str) -> dict[str, Any]:
        name = parse_template_name(name, field="name")
        if name in self.builtin_names:
            raise errors.InvalidArgument(f"built-in template {name!r} cannot be deleted", field="name")
        if name in self.building:
            raise errors.InvalidState(f"template {name!r} is being built", state="building")
        await self.sweep()
        pools = self.svc.agent.pools
        if pools is not None and name in pools.sizes:
            pools.sizes[name] = 0  # drained: never refilled, its ready members destroyed
            while (member := pools.take(name, pools.limits)) is not None:
                await pools.discard(member)
        result = await self._helper().call("template.delete", {"name": name})
        if name in self.svc.templates:
            self.svc.templates.remove(name)
        if not result.get("existed"):
            raise errors.NotFound(f"template {name!r} is not on this node", template=name)
        return {"name": name, "deleted": True}
