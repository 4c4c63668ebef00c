"""Fencing in the root helper (docs/adr/0033-fencing.md): the node's lease deadline is held HERE, not in the
agent, so a frozen or hung agent cannot keep its sandboxes running past it.

The agent renews the lease after each heartbeat the control plane acknowledged (`node.fence` with
`deadline`: a CLOCK_MONOTONIC time, the send time of that heartbeat plus the lease the answer granted; the
agent and the helper share the machine's monotonic clock). A timer thread of the helper waits for the
deadline; when it passes without a renewal, the helper FENCES the node: it pauses every live runtime at
once (in parallel), then tears every one down (the runtime ends; disks, bundles and snapshots stay), and
sweeps again until no runtime is left.

Invariants:
- The lease is unarmed until the agent's first renewal and after a `release` (a clean deregistration: the
  control plane will not recover this node's sandboxes elsewhere, so nothing needs fencing).
- A renewal never moves the deadline backwards, and a deadline more than MAX_LEASE_S ahead is refused.
- While the node is fenced (the deadline passed, no renewal since), the verbs that make a runtime run
  (create, start, resume, restore: `guarded`) are refused with Unavailable, so a late order cannot revive
  a fenced sandbox; a renewal lifts the fence (the control plane then decides what runs here).
- The fence does not wait for per-sandbox verb locks: a checkpoint that holds one for minutes must not
  delay a fence past its grace. A verb in flight on a fenced sandbox fails, and the sweep repeats until
  no runtime is left (or MAX_SWEEPS passes), so a runtime launched concurrently is caught too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, model_validator

from space.core import errors
from space.node.helper.context import Handler, HelperContext, Progress
from space.node.helper.params import Params

log = logging.getLogger("space.node.helper.fence")

MAX_LEASE_S = 3600.0
MAX_SWEEPS = 5
#: Runtime statuses (space.node.helper.runtime) in which a sandbox's processes exist.
LIVE = frozenset({"running", "paused", "created"})


class FenceParams(Params):
    """Exactly one of: `deadline` (renew: CLOCK_MONOTONIC seconds) or `release` (true: disarm)."""

    deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    release: bool = False

    @model_validator(mode="after")
    def _one(self) -> FenceParams:
        if (self.deadline is None) == (not self.release):
            raise ValueError("give either a deadline or release=true")
        return self


@dataclass
class Fence:
    """One node's lease: its deadline, the timer thread that enforces it, and what the last fence did."""

    ctx: HelperContext
    deadline: float | None = None  # monotonic; None: unarmed
    fenced: bool = False
    last: dict[str, Any] = field(default_factory=dict)  # the last fence's report
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    def renew(self, deadline: float) -> dict[str, Any]:
        now = time.monotonic()
        if deadline > now + MAX_LEASE_S:
            raise errors.InvalidArgument(
                f"a lease ends at most {MAX_LEASE_S:.0f} s from now", field="deadline"
            )
        with self._cond:
            was_fenced = self.fenced
            if deadline > now:
                self.deadline = max(deadline, self.deadline or 0.0)
                self.fenced = False
            self._ensure_thread()
            self._cond.notify_all()
            return {"armed": True, "was_fenced": was_fenced, "expires_in_s": (self.deadline or now) - now}

    def release(self) -> dict[str, Any]:
        with self._cond:
            self.deadline = None
            self.fenced = False
            self._cond.notify_all()
        log.info("fence released (clean deregistration): sandboxes keep running")
        return {"armed": False}

    def status(self) -> dict[str, Any]:
        with self._cond:
            left = None if self.deadline is None else self.deadline - time.monotonic()
            return {"armed": self.deadline is not None, "fenced": self.fenced, "expires_in_s": left,
                    "last": dict(self.last)}  # fmt: skip

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="fence", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while self.deadline is None or self.deadline > time.monotonic():
                    timeout = None if self.deadline is None else self.deadline - time.monotonic()
                    self._cond.wait(timeout)
                expired, self.deadline, self.fenced = self.deadline, None, True
            report = fence_node(self.ctx)
            report["late_s"] = round(report["started_monotonic"] - expired, 4)
            with self._cond:
                self.last = report


def _pause(ctx: HelperContext, sandbox_id: str) -> None:
    if ctx.runtimes.status(sandbox_id) == "running":
        with contextlib.suppress(errors.SpaceError):
            ctx.runtimes.pause(sandbox_id)


def _teardown(ctx: HelperContext, sandbox_id: str) -> None:
    try:
        ctx.runtimes.stop(sandbox_id)
    except errors.SpaceError as exc:
        log.error("fence: could not stop %s: %s", sandbox_id, exc)


def live_sandboxes(ctx: HelperContext) -> list[str]:
    root = ctx.layout.sandboxes
    ids = sorted(entry.name for entry in root.iterdir()) if root.exists() else []
    return [sandbox_id for sandbox_id in ids if ctx.runtimes.status(sandbox_id) in LIVE]


def fence_node(ctx: HelperContext) -> dict[str, Any]:
    """Pause every live runtime at once, then tear each down; repeat until none is left. Returns a report
    (what was paused and stopped, and when: wall and monotonic times, for the tests and the log)."""
    started, started_at = time.monotonic(), time.time()
    stopped: list[str] = []
    paused_at = None
    for _ in range(MAX_SWEEPS):
        live = live_sandboxes(ctx)
        if not live:
            break
        with ThreadPoolExecutor(max_workers=min(16, len(live)), thread_name_prefix="fence") as pool:
            list(pool.map(lambda sandbox_id: _pause(ctx, sandbox_id), live))
            paused_at = paused_at or time.time()
            list(pool.map(lambda sandbox_id: _teardown(ctx, sandbox_id), live))
        stopped.extend(s for s in live if s not in stopped)
    left = live_sandboxes(ctx)
    report = {"started_monotonic": started, "started_at": started_at, "paused_at": paused_at,
              "done_at": time.time(), "stopped": stopped, "left": left}  # fmt: skip
    leftover = f" ({len(left)} LEFT: {left})" if left else ""
    log.warning("FENCED: the lease expired without renewal; paused then stopped %d sandboxes in %.0f ms%s",
                len(stopped), (time.monotonic() - started) * 1000, leftover)  # fmt: skip
    return report


_fences: dict[str, Fence] = {}
_fences_guard = threading.Lock()


def fence_of(ctx: HelperContext) -> Fence:
    """The one Fence of the node at ctx's data directory."""
    with _fences_guard:
        return _fences.setdefault(str(ctx.layout.data_dir), Fence(ctx))


def node_fence(ctx: HelperContext, params: FenceParams, _progress: Progress) -> dict[str, Any]:
    fence = fence_of(ctx)
    if params.release:
        return fence.release()
    assert params.deadline is not None
    return fence.renew(params.deadline)


def node_fence_status(ctx: HelperContext, _params: Params, _progress: Progress) -> dict[str, Any]:
    return fence_of(ctx).status()


def guarded(handler: Handler) -> Handler:
    """`handler`, refused while the node is fenced (it would make a runtime run)."""

    def run(ctx: HelperContext, params: Any, progress: Progress) -> dict[str, Any]:
        if fence_of(ctx).status()["fenced"]:
            raise errors.Unavailable(
                "this node is fenced (its lease expired): no runtime starts until renewed"
            )
        return handler(ctx, params, progress)

    return run
