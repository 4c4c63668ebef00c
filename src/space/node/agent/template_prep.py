"""The node agent's preparation of templates: the node itself, each template's base (shared with other
nodes through the object store) and its warm start.

Invariants:
- With an object store, every node holds the same template base (a node that lacks it fetches it; the
  first node that has the original stream and finds none in the store publishes it), so checkpoint deltas
  apply on any node. Publishing is best effort: a node works whether or not it published.
- A warm start is a full checkpoint of a freshly booted sandbox whose daemon finished initialising; the
  sandbox used to make it is destroyed afterwards, whatever happened.
- The node's runtime descriptor (`node_runtime`, ADR 0035) is read once the driver has prepared the node
  and kept; until it can be read it is None (unknown), and asked again next time.
- A template's start command, started by the cold boot a warm start is made from, has exited or run for
  template_start.START_SETTLE_S before the checkpoint is taken (its processes are in the warm start).
- A built-in template the node was not told to prepare (`base` on a node started with `python` only) is
  built on its first create (`ensure_builtin_here`: a snapshot of the shared base, ~1 s; ADR 0057), once
  per agent; it has no warm start unless prepared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from space.core import errors, runtimes
from space.node.agent import runtime_info, template_start, transfer
from space.node.agent.sandbox_snapshots import SandboxSnapshots
from space.node.drivers.base import Progress
from space.objectstore.artifacts import Manifest

log = logging.getLogger("space.node.agent.agent")
#: A fetched template base that fails verification is read again this often (another node may be
#: re-publishing the same stream at that moment), this many seconds apart.
TEMPLATE_FETCH_ATTEMPTS = 3
TEMPLATE_FETCH_RETRY_S = 2.0
#: The templates every node can build from its base (space.node.volumes.templates.BUILTIN_TEMPLATES, which
#: the unprivileged agent may not import; tests/node/test_base_template.py checks that the two agree).
BUILTIN_TEMPLATE_NAMES = ("python", "base", "browser")


class TemplatePreparation(SandboxSnapshots):
    """Node and template preparation over the snapshot verbs (a warm start is a checkpoint)."""

    _runtime: runtimes.Descriptor | None = None
    #: Told the name of each template that arrived on this node other than by a build here or a prepare (a
    #: user template fetched on first use: template_travel; a built-in built on its first create); the node
    #: service hooks it to add the name to what it reports (info, heartbeat).
    template_arrived: Callable[[str], None] | None = None
    _builtins_here: frozenset[str] = frozenset()  # built-ins this agent ensured (prepared or first used)

    def node_runtime(self) -> runtimes.Descriptor | None:
        """What this node's runtime can restore (space.core.runtimes); None while unknown."""
        if self._runtime is None:
            self._runtime = runtime_info.node_runtime(self.driver)
        return self._runtime

    # -- set-up ------------------------------------------------------------------------------------------
    async def prepare(
        self, templates: tuple[str, ...] = ("python",), progress: Progress | None = None
    ) -> None:
        await self.driver.prepare(progress)
        self._runtime = runtime_info.node_runtime(self.driver)  # published by the prepare just done
        for name in templates:
            await self.ensure_template(name, progress)
            await self.ensure_warm(name, progress)

    async def ensure_builtin_here(self, name: str) -> None:
        """Before a create of `name`: a built-in template not yet ensured by this agent is built (or found)
        now; anything else is left to the create (a user template travels, an unknown one is NotFound)."""
        if name not in BUILTIN_TEMPLATE_NAMES or name in self._builtins_here:
            return
        await self.ensure_template(name)
        if self.template_arrived is not None:
            self.template_arrived(name)  # the node reports it from now on

    async def ensure_template(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        """Make template `name` available. With an object store, a node that lacks the template base takes
        it from there (so every node holds the same base and deltas apply anywhere); a node that has the
        base's original stream and finds none in the store publishes it."""
        status = await self.driver.template_base_status() if self.store is not None else None
        if self.store is not None and status is not None:
            prefix = transfer.template_prefix(str(status["name"]), str(status["version"]))
            manifest = await asyncio.to_thread(transfer.existing_manifest, self.store, prefix)
            if not status["present"] and manifest is not None:
                for attempt in range(TEMPLATE_FETCH_ATTEMPTS):
                    try:
                        await self._fetch_template_base(manifest, progress)
                        break
                    except errors.ArtifactCorrupt:
                        # Possibly another node re-publishing the same stream right now (its writer
                        # first clears stray parts): read the manifest again; the last failure is real.
                        if attempt == TEMPLATE_FETCH_ATTEMPTS - 1:
                            raise
                        await asyncio.sleep(TEMPLATE_FETCH_RETRY_S)
                        manifest = await asyncio.to_thread(transfer.existing_manifest, self.store, prefix)
                        if manifest is None:
                            break
        info = await self.driver.ensure_template(name, progress)
        if name in BUILTIN_TEMPLATE_NAMES:
            self._builtins_here = self._builtins_here | {name}
        if self.store is not None and status is not None:
            status = await self.driver.template_base_status()
            assert status is not None
            prefix = transfer.template_prefix(str(status["name"]), str(status["version"]))
            exists = await asyncio.to_thread(transfer.existing_manifest, self.store, prefix)
            if exists is None and status["present"] and status["publishable"]:
                await self._publish_template_base(prefix, progress)
        return info

    async def _fetch_template_base(self, manifest: Manifest, progress: Progress | None) -> None:
        assert self.store is not None
        if progress is not None:
            progress(f"space: fetching the template base from {manifest.prefix}")
        directory = await self.driver.prepare_base_import()
        try:
            await asyncio.to_thread(
                transfer.download, self.store, manifest, directory, data_key=None, skip=set()
            )
            await self.driver.import_template_base()
        finally:
            await self.driver.release_staging("base-import")

    async def _publish_template_base(self, prefix: str, progress: Progress | None) -> None:
        assert self.store is not None
        if progress is not None:
            progress(f"space: publishing the template base to {prefix}")
        try:
            staged = await self.driver.export_template_base()
            await asyncio.to_thread(
                transfer.upload, self.store, prefix, staged.directory, staged.files,
                data_key=None, metadata=staged.metadata,
            )  # fmt: skip
        except errors.SpaceError as exc:
            # Another node publishing the same original stream at the same moment (AlreadyExists, or its
            # manifest replacing ours before our read-back), or the store is down: this node works either
            # way, and the next node start publishes again if the store still lacks the base.
            log.warning("template base not published to %s: %s", prefix, exc.message)
        finally:
            await self.driver.release_staging("base-export")

    async def ensure_warm(self, template: str, progress: Progress | None = None) -> None:
        """Give `template` a warm start: boot one sandbox of it, let its daemon finish initialising, take a
        full checkpoint, and hand that to the driver. Later creates restore it instead of booting."""
        if not self.driver.warm_supported or await self.driver.warm_ready(template):
            return
        if progress is not None:
            progress(f"preparing the warm start of template {template}")
        handle = await self.create(template, warm=False)
        try:
            session = handle.session
            if handle.start_process is not None:  # its start command's work goes into the warm start
                await template_start.settle(session, template, handle.start_process)
            await session.processes()  # loads the daemon's process code, as the first exec would
            await session.stat("/")  # and its file code
            record = await self.checkpoint(handle.sandbox_id)
            await self._close_channel(handle)
            await self.driver.adopt_warm(template, handle.sandbox_id, record.snapshot_id)
        finally:
            self.sandboxes.pop(handle.sandbox_id, None)
            with contextlib.suppress(errors.SpaceError):
                await self.driver.destroy(handle.sandbox_id)
