"""The gVisor driver: each sandbox runs on its own application kernel (runsc), driven via the root helper.

Invariants:
- The agent holding this driver is unprivileged: every privileged step is one helper verb; the agent only
  opens the per-sandbox channel sockets that the helper's holders hand to its uid.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from space.core.settings import SandboxLimits
from space.node.agent.channel import GuestChannel
from space.node.agent.helper_client import HelperClient
from space.node.agent.identity import identity_dir
from space.node.agent.runtime_names import RuntimeNames
from space.node.drivers.base import (
    CheckpointInfo,
    Driver,
    Progress,
    RuntimeState,
    SandboxSpec,
    StagedFiles,
    staging_release_args,
)
from space.node.layout import NodeLayout

BOOT_TIMEOUT_S = 30.0


class RunscDriver(Driver):
    name = "runsc"
    isolating = True
    warm_supported = True
    resumes_after_checkpoint = True  # the same runsc container resumes: its holder and channel stay

    def __init__(self, layout: NodeLayout, helper: HelperClient) -> None:
        self.layout = layout
        self.helper = helper
        # Pooled runtimes and the sandbox ids bound to them (ADR 0047): the helper client translates.
        self.names: RuntimeNames = RuntimeNames(self.state_file("runtime-names.json"))
        helper.names = self.names

    def state_file(self, name: str) -> pathlib.Path | None:
        # The agent's private 0700 directory (the helper's node.prepare makes it for the agent's user; the
        # data directory itself is root's): the node's identity and the agent's own small state.
        return identity_dir(self.layout.data_dir) / name

    async def prepare(self, progress: Progress | None = None) -> None:
        await self.helper.call("node.prepare", progress=progress, timeout=300.0)

    async def ensure_template(self, name: str, progress: Progress | None = None) -> dict[str, Any]:
        return await self.helper.call("template.ensure", {"name": name}, progress=progress, timeout=1800.0)

    async def create(self, spec: SandboxSpec) -> None:
        await self.helper.call(
            "sandbox.create",
            {"sandbox_id": spec.sandbox_id, "template": spec.template,
             "limits": spec.limits.model_dump(), "env": dict(spec.env)},
        )  # fmt: skip

    async def create_warm(self, spec: SandboxSpec) -> GuestChannel | None:
        result = await self.helper.call(
            "sandbox.create",
            {"sandbox_id": spec.sandbox_id, "template": spec.template,
             "limits": spec.limits.model_dump(), "env": dict(spec.env), "warm": True},
        )  # fmt: skip
        if "socket" not in result:
            # No warm start for this template: the files are in place, boot it the usual way.
            return await self.start(spec.sandbox_id)
        return await self._channel(spec.sandbox_id, str(result["socket"]))

    async def create_pooled(self, spec: SandboxSpec) -> GuestChannel:
        channel = await self.create_warm(spec)
        assert channel is not None  # this driver's create_warm always starts the sandbox
        return channel

    async def bind_pooled(self, spec: SandboxSpec, channel: GuestChannel) -> None:
        await self.helper.call("sandbox.configure", {"sandbox_id": spec.sandbox_id, "env": dict(spec.env)})

    async def warm_ready(self, template: str) -> bool:
        return bool((await self.helper.call("template.warm_status", {"name": template}))["ready"])

    async def start_command(self, template: str) -> str | None:
        for held in (await self.helper.call("template.list", {}))["templates"]:
            if held["name"] == template:
                value = held["metadata"].get("start_cmd")
                return value if isinstance(value, str) and value else None
        return None

    async def adopt_warm(self, template: str, sandbox_id: str, snapshot_id: str) -> None:
        await self.helper.call(
            "template.adopt_warm", {"name": template, "sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )

    async def _channel(self, sandbox_id: str, socket_path: str) -> GuestChannel:
        return await GuestChannel.connect_unix(socket_path, timeout=BOOT_TIMEOUT_S, name=sandbox_id)

    async def start(self, sandbox_id: str) -> GuestChannel:
        result = await self.helper.call("sandbox.start", {"sandbox_id": sandbox_id})
        return await self._channel(sandbox_id, str(result["socket"]))

    async def connect(self, sandbox_id: str) -> GuestChannel:
        socket_path = self.layout.channel_socket(self.names.to_runtime(sandbox_id))
        return await self._channel(sandbox_id, str(socket_path))

    async def pause(self, sandbox_id: str) -> None:
        await self.helper.call("sandbox.pause", {"sandbox_id": sandbox_id})

    async def resume(self, sandbox_id: str) -> None:
        await self.helper.call("sandbox.resume", {"sandbox_id": sandbox_id})

    async def checkpoint(
        self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True, leave_paused: bool = False
    ) -> tuple[CheckpointInfo, GuestChannel | None]:
        args: dict[str, Any] = {
            "sandbox_id": sandbox_id,
            "snapshot_id": snapshot_id,
            "keep_running": keep_running,
        }
        if leave_paused:
            args["leave_paused"] = True
        result = await self.helper.call("sandbox.checkpoint", args, timeout=600.0)
        info = CheckpointInfo(sandbox_id, snapshot_id, int(result["image_bytes"]), dict(result["timings"]))
        # The runtime keeps running with its channel; a new socket only comes from drivers that restart it.
        channel = await self._channel(sandbox_id, str(result["socket"])) if "socket" in result else None
        return info, channel

    async def restore(
        self,
        sandbox_id: str,
        snapshot_id: str,
        *,
        source_sandbox_id: str | None = None,
        limits: SandboxLimits | None = None,
    ) -> GuestChannel:
        args: dict[str, Any] = {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        if source_sandbox_id is not None:
            args["source_sandbox_id"] = source_sandbox_id
        if limits is not None:
            args["limits"] = limits.model_dump()
        result = await self.helper.call("sandbox.restore", args, timeout=600.0)
        return await self._channel(sandbox_id, str(result["socket"]))

    async def disk_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        await self.helper.call(
            "sandbox.disk_snapshot", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )

    async def reset_rootfs(self, sandbox_id: str, snapshot_id: str) -> None:
        await self.helper.call("sandbox.reset_rootfs", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id})

    async def delete_snapshot(self, sandbox_id: str, snapshot_id: str) -> None:
        await self.helper.call("snapshot.delete", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id})

    async def list_snapshots(self, sandbox_id: str) -> list[dict[str, Any]]:
        result = await self.helper.call("snapshot.list", {"sandbox_id": sandbox_id})
        return list(result["snapshots"])

    async def stop(self, sandbox_id: str) -> None:
        await self.helper.call("sandbox.stop", {"sandbox_id": sandbox_id})

    async def discard(self, sandbox_id: str) -> None:
        await self.helper.call("sandbox.discard", {"sandbox_id": sandbox_id})

    async def destroy(self, sandbox_id: str) -> None:
        await self.helper.call("sandbox.destroy", {"sandbox_id": sandbox_id})

    async def state(self, sandbox_id: str) -> RuntimeState:
        return _runtime_state(await self.helper.call("sandbox.state", {"sandbox_id": sandbox_id}))

    async def list(self) -> list[RuntimeState]:
        result = await self.helper.call("sandbox.list")
        return [_runtime_state(item) for item in result["sandboxes"]]

    async def usage(self, sandbox_id: str) -> dict[str, Any]:
        return await self.helper.call("sandbox.usage", {"sandbox_id": sandbox_id})

    async def metrics(self, sandbox_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        # One helper call (space.node.helper.metrics_verbs); the list is not an id field the client
        # translates, so runtime ids are named here and the answer's `sandbox_id`s come back translated.
        runtime_ids = [self.names.to_runtime(sandbox_id) for sandbox_id in sandbox_ids]
        result = await self.helper.call("sandbox.metrics", {"sandbox_ids": runtime_ids})
        return {str(item["sandbox_id"]): item for item in result.get("sandboxes", [])}

    async def storage_usage(self, sandbox_id: str, *, fresh: bool = True) -> dict[str, Any] | None:
        return await self.helper.call("sandbox.storage", {"sandbox_id": sandbox_id, "sync": fresh})

    async def disk_space(self) -> dict[str, int] | None:
        result = await self.helper.call("node.disk")
        return {"total_bytes": int(result["total_bytes"]), "free_bytes": int(result["free_bytes"])}

    async def close(self) -> None:
        await self.helper.close()

    # -- object storage transfers (space.node.helper.transfer) ----------------------------------------------
    async def export_snapshot(self, sandbox_id: str, snapshot_id: str) -> StagedFiles:
        result = await self.helper.call(
            "snapshot.export", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}, timeout=600.0
        )
        return _staged(result)

    async def prepare_import(self, sandbox_id: str, snapshot_id: str) -> pathlib.Path:
        result = await self.helper.call(
            "staging.prepare", {"kind": "import", "sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )
        return pathlib.Path(result["dir"])

    async def import_snapshot(self, spec: SandboxSpec, snapshot_id: str) -> None:
        await self.helper.call(
            "snapshot.import",
            {"sandbox_id": spec.sandbox_id, "snapshot_id": snapshot_id, "template": spec.template,
             "limits": spec.limits.model_dump(), "env": dict(spec.env)},
            timeout=600.0,
        )  # fmt: skip

    async def release_staging(
        self, kind: str, sandbox_id: str | None = None, snapshot_id: str | None = None
    ) -> None:
        await self.helper.call("staging.release", staging_release_args(kind, sandbox_id, snapshot_id))

    async def snapshot_usage(self, sandbox_id: str, snapshot_id: str) -> dict[str, Any]:
        return await self.helper.call(
            "snapshot.usage", {"sandbox_id": sandbox_id, "snapshot_id": snapshot_id}
        )

    async def template_base_status(self) -> dict[str, Any] | None:
        return await self.helper.call("template.base_status")

    async def export_template_base(self) -> StagedFiles:
        return _staged(await self.helper.call("template.base_export", timeout=1800.0))

    async def prepare_base_import(self) -> pathlib.Path:
        return pathlib.Path((await self.helper.call("staging.prepare", {"kind": "base-import"}))["dir"])

    async def import_template_base(self) -> dict[str, Any]:
        return await self.helper.call("template.base_import", timeout=1800.0)


def _staged(result: dict[str, Any]) -> StagedFiles:
    return StagedFiles(
        directory=pathlib.Path(str(result["dir"])),
        files={str(k): int(v) for k, v in dict(result["files"]).items()},
        metadata=dict(result.get("metadata") or {}),
        timings={str(k): float(v) for k, v in dict(result.get("timings") or {}).items()},
    )


def _runtime_state(raw: dict[str, Any]) -> RuntimeState:
    spec = None
    if isinstance(raw.get("spec"), dict):
        saved = raw["spec"]
        spec = SandboxSpec(
            sandbox_id=str(raw["sandbox_id"]),
            template=str(saved.get("template", "python")),
            limits=SandboxLimits.model_validate(saved.get("limits") or {}),
            env=dict(saved.get("env") or {}),
        )
    return RuntimeState(
        spec=spec,
        sandbox_id=str(raw["sandbox_id"]),
        exists=bool(raw["exists"]),
        runtime=str(raw["runtime"]),
        channel_open=bool(raw["holder"]),
        exit=raw.get("exit"),
    )
