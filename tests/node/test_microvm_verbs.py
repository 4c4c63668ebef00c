"""Attacks on the helper's microvm.* verbs: every argument is parsed before a handler runs."""

from __future__ import annotations

from typing import Any

import pytest

from space.core import ids
from space.node.helper.server import dispatch
from space.node.helper.verbs import VERBS

SANDBOX = ids.new_sandbox_id()
SNAPSHOT = ids.new_snapshot_id()


def refused(verb: str, args: dict[str, Any]) -> dict[str, Any]:
    # No context: a request that reached a handler would fail on it, not be refused as invalid_argument.
    answer = dispatch(None, {"verb": verb, "args": args}, lambda _line: None)  # type: ignore[arg-type]
    assert answer["ok"] is False
    return dict(answer["error"])


@pytest.mark.parametrize(
    ("verb", "args"),
    [
        ("microvm.create", {"sandbox_id": "../../etc", "template": "python"}),
        ("microvm.create", {"sandbox_id": SANDBOX, "template": "../python"}),
        ("microvm.create", {"sandbox_id": SANDBOX, "template": "python", "disk": "/etc/shadow"}),
        ("microvm.create", {"sandbox_id": SANDBOX + "%2f..", "template": "python"}),
        ("microvm.restore", {"sandbox_id": SANDBOX, "snapshot_id": "snap/../../x"}),
        ("microvm.restore", {"sandbox_id": SANDBOX, "snapshot_id": SNAPSHOT, "source_sandbox_id": "sb-x"}),
        ("microvm.checkpoint", {"sandbox_id": SANDBOX, "snapshot_id": SNAPSHOT, "keep_running": "yes"}),
        ("microvm.template_boot", {"name": "python", "memory_mb": 1 << 40}),
        ("microvm.template_boot", {"name": "python", "vcpus": 0}),
        ("microvm.template_boot", {"name": "a" * 10_000}),
        ("microvm.pause", {"sandbox_id": SANDBOX, "extra": 1}),
        ("microvm.destroy", {"sandbox_id": "sb-" + "A" * 26}),
        ("microvm.snapshot_delete", {"sandbox_id": SANDBOX, "snapshot_id": "../" + SNAPSHOT}),
        ("microvm.snapshot_list", {"sandbox_id": SANDBOX + "/.."}),
        # through object storage (ADR 0081): no path, no other staging name, no template path
        ("microvm.export", {"sandbox_id": SANDBOX, "snapshot_id": SNAPSHOT + "/../x"}),
        ("microvm.export", {"sandbox_id": SANDBOX, "snapshot_id": SNAPSHOT, "dir": "/etc"}),
        ("microvm.import", {"sandbox_id": SANDBOX, "snapshot_id": SNAPSHOT, "template": "../python"}),
        ("microvm.import", {"sandbox_id": SANDBOX, "snapshot_id": SNAPSHOT}),  # the template is named
        ("microvm.import", {"sandbox_id": SANDBOX + "%2f..", "snapshot_id": SNAPSHOT, "template": "python"}),
        ("microvm.import", {"sandbox_id": SANDBOX, "snapshot_id": "x" * 10_000, "template": "python"}),
    ],
)
def test_microvm_verbs_refuse_malformed_arguments(verb: str, args: dict[str, Any]) -> None:
    assert refused(verb, args)["code"] == "invalid_argument"


def test_every_microvm_verb_that_starts_a_qemu_is_fenced_and_sandbox_scoped() -> None:
    microvm = {name: verb for name, verb in VERBS.items() if name.startswith("microvm.")}
    assert len(microvm) == 17
    for name in (
        "microvm.create",
        "microvm.restore",
        "microvm.resume",
        "microvm.start",
        "microvm.template_boot",
    ):
        assert microvm[name].handler.__name__ == "run", name  # wrapped by fence_verbs.guarded
    for name, verb in microvm.items():
        if "sandbox_id" in verb.params.model_fields:
            assert verb.sandbox_scoped or name in {"microvm.state", "microvm.snapshot_list"}, name  # reads


def test_a_node_configured_with_the_qemu_driver_runs_microvms(tmp_path: Any) -> None:
    from space.node.agent.settings import NodeAgentSettings
    from space.node.drivers.qemu import QemuDriver
    from space.node.drivers.runsc import RunscDriver
    from space.node.local import connect_agent

    assert isinstance(connect_agent(tmp_path).driver, RunscDriver)  # the default stays gVisor
    agent = connect_agent(tmp_path, settings=NodeAgentSettings(driver="qemu"))
    assert isinstance(agent.driver, QemuDriver) and agent.driver.warm_supported
    with pytest.raises(ValueError, match="driver"):
        NodeAgentSettings(driver="firecracker")  # type: ignore[arg-type]


def test_a_template_checkpoint_is_stale_once_the_template_or_the_machine_changes(tmp_path: Any) -> None:
    import json
    import pathlib

    from space.node.helper.microvm import Machine, MicroVMs
    from space.node.layout import NodeLayout

    vms = MicroVMs(NodeLayout(pathlib.Path(tmp_path)), 0, accel="tcg")
    vms.layout.templates.mkdir(parents=True)
    (vms.layout.templates / "python.json").write_text('{"built": 1}')
    vms.template_dir("python").mkdir(parents=True)
    meta = {"memory_mb": 512, "vcpus": 1, "template_stamp": vms.template_stamp("python")}
    (vms.template_dir("python") / "meta.json").write_text(json.dumps(meta))
    assert vms.template_ready("python", Machine())
    assert not vms.template_ready("python", Machine(memory_mb=1024))
    (vms.layout.templates / "python.json").write_text('{"built": 2}')  # the template was rebuilt
    assert not vms.template_ready("python")
    assert not MicroVMs(vms.layout, 0, accel="kvm").template_ready("python")
    assert not vms.template_ready("absent")
