"""What the qemu driver cannot do yet is a typed refusal (issue 15, ADR 0076): NotSupported, answered as 409
`not_supported` naming the microvm isolation, never a NotImplementedError (a 500 the reconciler retried).
No helper is asked: each refusal happens before any call (a helper that is called fails the test). And
the node reports the qemu driver, which placement matches microvm sandboxes to (its egress, since ADR
0080, is tested for real in tests/e2e/test_microvm_egress_e2e.py)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from space.core import errors, isolation, runtimes
from space.node.agent import runtime_info
from space.node.drivers.base import SandboxSpec
from space.node.drivers.qemu import QemuDriver
from space.node.layout import NodeLayout
from space.rest.errors import status_for

SPEC = SandboxSpec("sb-00000000000000000000000000", "python")


class _NoHelper:
    async def call(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the helper was asked: {args}")


def _refusals(driver: QemuDriver) -> dict[str, Callable[[], Awaitable[Any]]]:
    sid, snap = SPEC.sandbox_id, "snap-00000000000000000000000000"
    return {
        "disk_snapshot": lambda: driver.disk_snapshot(sid, snap),
        "disk_rollback": lambda: driver.reset_rootfs(sid, snap),
        "cold_create": lambda: driver.create(SPEC),
        "template_checkpoint": lambda: driver.adopt_warm("python", sid, snap),
    }


def _driver() -> QemuDriver:
    return QemuDriver(NodeLayout(pathlib.Path("/nonexistent")), _NoHelper())  # type: ignore[arg-type]


@pytest.mark.parametrize("operation", list(_refusals(_driver())))
def test_each_missing_operation_is_a_409_naming_microvm(operation: str) -> None:
    driver = _driver()
    with pytest.raises(errors.NotSupported) as caught:
        asyncio.run(_refusals(driver)[operation]())
    error = caught.value
    assert error.details == {"isolation": "microvm", "operation": operation.strip()}
    assert "microvm sandboxes" in error.message
    assert error.message == isolation.unsupported("microvm", operation.strip())
    assert status_for(error) == 409
    assert errors.error_from_dict(error.to_dict()).code == "not_supported"  # as it crosses the node RPC


def test_the_disk_snapshot_message_says_what_to_do_instead() -> None:
    assert isolation.unsupported("microvm", "disk_snapshot") == (
        "disk snapshots are not supported for microvm sandboxes; take a full snapshot"
    )
    assert isolation.unsupported("gvisor", "disk_snapshot") is None


def test_a_qemu_node_reports_the_qemu_driver_whatever_its_helper_published(tmp_path: pathlib.Path) -> None:
    """Placement matches microvm sandboxes to nodes by this descriptor; the helper of a qemu node also
    publishes its runsc's (node.prepare), which must not make the node look like a gVisor one."""
    layout = NodeLayout(tmp_path)
    layout.run.mkdir(parents=True)
    (layout.run / runtime_info.RUNTIME_DESCRIPTOR).write_text('{"driver": "runsc", "platform": "systrap"}')
    driver = QemuDriver(layout, _NoHelper())  # type: ignore[arg-type]
    assert runtime_info.node_runtime(driver) == runtimes.describe("qemu")
    assert isolation.of_node(runtime_info.node_runtime(driver)) == "microvm"
