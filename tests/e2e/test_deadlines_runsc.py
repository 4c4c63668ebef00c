"""A deadline with `on_timeout: pause` on the real runsc node (`real_cluster`, whose control plane has object
storage): when it passes, the sandbox is kept SUSPENDED (its state in the object store, nothing left on the
node, no deadline), its files intact; the next use restores it, and it comes back with a fresh deadline of
its timeout. docs/adr/0048-metadata-lists-and-deadlines.md; the fake-driver tests of the same API, with
their attacks, are tests/controlplane/test_sandbox_lists_and_deadlines_api.py."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from tests.support import cluster as c

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

LIMITS = {"cpus": 1.0, "memory_mb": 256}


def test_an_expired_pause_sandbox_is_kept_suspended_and_comes_back_on_use(
    real_cluster: c.RealCluster,
) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(
            template="python", limits=LIMITS, ttl_s=3600, on_timeout="pause", metadata={"test": "deadline"}
        )
        try:
            sb.files.write("/work/kept.txt", b"kept through the deadline\n")
            assert sb.exec("echo $((6 * 7)) > /work/answer").exit_code == 0
            sb.set_timeout(0)  # the deadline is now: the reconciler acts on it at once

            def suspended() -> bool:
                return sp.sandboxes.get(sb.id).state == "suspended"

            c.wait_for(suspended, timeout=180, interval=0.5, what=f"{sb.id} suspended at its deadline")
            kept = sp.sandboxes.get(sb.id)
            assert (kept.data["desired_state"], kept.expires_at) == ("suspended", None)
            assert kept.data["suspended_snapshot_id"]
            c.wait_for(
                lambda: sb.id not in c.sandbox_ids_in(real_cluster.data_dir), timeout=60, interval=0.2,
                what="the node freed of the suspended sandbox",
            )  # fmt: skip
            assert [s.id for s in sp.sandboxes.list(state="suspended", metadata={"test": "deadline"})] == [
                sb.id
            ]
            assert "sandbox.expired" in [event.kind for event in sb.events()]

            # First use: restored (on the node), files intact, a fresh deadline of its timeout.
            assert sb.files.read("/work/kept.txt") == b"kept through the deadline\n"
            assert sb.exec("cat /work/answer").stdout == "42\n"
            back = sp.sandboxes.get(sb.id)
            assert back.state == "running" and back.expires_at is not None
            fresh = datetime.fromisoformat(back.expires_at) - datetime.fromisoformat(back.data["updated_at"])
            assert fresh == timedelta(seconds=3600), back.data
        finally:
            sb.delete()
