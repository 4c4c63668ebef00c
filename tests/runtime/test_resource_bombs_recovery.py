"""A memory hog inside a real runsc sandbox cannot be held inside it (ADR 0036): the guest's memory lives in
gVisor's own kernel, so it is the host's memory limit that stops it, by killing the sandbox's runtime. Then
the sandbox is recovered automatically from its newest full checkpoint, visibly: the node reports the
crash with its reason, the record goes crashed -> recovering -> running with a notice, and the sandbox's
events say `sandbox.crashed` (naming the memory limit) and `sandbox.recovered`. A neighbour never notices.
Through the API of a real installation (`real_cluster`: control plane, node agent, root helper, runsc)."""

from __future__ import annotations

from typing import Any

import pytest

from space.sdk import SpaceError
from tests.support import cluster as c

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

MEMORY_HOG = """
chunks = []
for i in range(2048):
    chunks.append(bytearray(b"x") * (1 << 20))  # written, so every page is really used
print("allocated 2 GiB", flush=True)
"""


def test_a_memory_hog_is_recovered_from_its_newest_checkpoint(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        hog = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        neighbour = sp.sandboxes.create(limits={"cpus": 0.5, "memory_mb": 256})
        try:
            hog.files.write("/work/state.txt", b"checkpointed")
            snap = hog.snapshots.create(full=True)
            hog.files.write("/work/state.txt", b"lost with the runtime")
            try:
                result = hog.exec(["python3", "-c", MEMORY_HOG], timeout=60)
                outcome = f"exit {result.exit_code}: {result.stdout[-200:]!r}"
                assert not result.ok and "allocated 2 GiB" not in result.stdout, outcome
            except SpaceError as exc:  # the runtime died under the exec
                outcome = f"{exc.code}: {exc}"

            def recovered() -> dict[str, Any] | None:
                view = hog.refresh().data
                return view if view["state"] == "running" and view["recovered_at"] else None

            view = c.wait_for(recovered, timeout=120, interval=0.2, what="recovered after the memory hog")
            print(f"memory hog: {outcome}; recovered: {view['notice']}")
            assert view is not None and view["recovered_from"] == snap.id and view["crash_count"] >= 1
            events = hog.events()
            kinds = [e.kind for e in events]
            assert "sandbox.crashed" in kinds and "sandbox.recovered" in kinds, kinds
            assert kinds.index("sandbox.crashed") < kinds.index("sandbox.recovered"), kinds
            crashed = next(e for e in events if e.kind == "sandbox.crashed")
            assert "memory limit (256 MB)" in crashed.message, crashed.message
            # Back as it was at the checkpoint, and it answers.
            assert hog.files.read("/work/state.txt") == b"checkpointed"
            assert hog.exec("echo back").stdout == "back\n"
            # The neighbour never noticed.
            assert neighbour.exec("echo fine").stdout == "fine\n"
            assert neighbour.refresh().data["crash_count"] == 0
        finally:
            hog.delete()
            neighbour.delete()
