"""The node agent's side of fencing (docs/adr/0033-fencing.md): it turns each acknowledged heartbeat into a
lease deadline and hands that deadline to whatever enforces it.

    deadline = monotonic time at which the heartbeat was SENT + the answer's `fence_after_s`

Measuring from the send time (not the answer's arrival) makes the deadline conservative: the control plane
stamped the heartbeat after it was sent, and marks the node lost `node_lost_after_s` (> fence_after_s)
after that stamp.

Invariants:
- On a runsc node the deadline lives in the ROOT HELPER (`node.fence`, space.node.helper.fence_verbs),
  whose own timer pauses and tears down every runtime when it passes: a frozen agent (SIGSTOP, a hung
  event loop) is fenced all the same. The agent only renews it.
- Without a helper (the fake driver, development only) the agent enforces the deadline on its own event
  loop if NodeAgentSettings.fence_without_helper is set (that covers a partition, not a frozen agent);
  by default it does not (`Fence(None)` without `on_expiry` only tracks the lease).
- An answer that arrives after its own deadline renews nothing (the lease it granted is already over).
- `release` disarms the fence: only after the control plane accepted a clean deregistration (the node is
  `offline`, never marked lost, so its sandboxes are never restored elsewhere and must stay for the next
  start to adopt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from space.node.agent.helper_client import HelperClient

log = logging.getLogger(__name__)

#: A renewal is a local call to the helper: it must not hold up the heartbeat loop for long.
RENEW_TIMEOUT_S = 5.0


class Fence:
    """Renews the node's lease in the helper, or (no helper) watches it on this event loop and calls
    `on_expiry` when it passes."""

    def __init__(
        self, helper: HelperClient | None, on_expiry: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.helper = helper
        self.on_expiry = on_expiry
        self.deadline: float | None = None
        self.fenced = False
        self._watchdog: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def renew(self, sent_at: float, lease_s: float) -> bool:
        """The heartbeat sent at monotonic `sent_at` was acknowledged with a lease of `lease_s` s; False if
        that lease is already over (nothing renewed)."""
        deadline = sent_at + lease_s
        if deadline <= time.monotonic():
            log.warning("a heartbeat answer came after its lease ended (%.2f s late): not renewed",
                        time.monotonic() - deadline)  # fmt: skip
            return False
        if self.helper is not None:
            answer = await self.helper.call("node.fence", {"deadline": deadline}, timeout=RENEW_TIMEOUT_S)
            if answer.get("was_fenced"):
                log.warning("the control plane is reachable again after this node fenced its sandboxes")
        elif self.fenced:
            log.warning("the control plane is reachable again after this node fenced its sandboxes")
        self.deadline, self.fenced = deadline, False
        if self.helper is None and self.on_expiry is not None:
            self._ensure_watchdog()
        return True

    async def release(self) -> None:
        """Disarm (after a clean deregistration only)."""
        self.deadline = None
        self._wake.set()
        if self.helper is not None:
            await self.helper.call("node.fence", {"release": True}, timeout=RENEW_TIMEOUT_S)

    async def close(self) -> None:
        """Stop the in-process watchdog (the helper's fence, if any, stays armed: see `release`)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog

    def _ensure_watchdog(self) -> None:
        self._wake.set()
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch(), name="fence-watchdog")

    async def _watch(self) -> None:
        while True:
            self._wake.clear()
            if self.deadline is None:
                await self._wake.wait()
                continue
            left = self.deadline - time.monotonic()
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), left)
                continue
            self.deadline, self.fenced = None, True
            log.warning("FENCED: the lease expired without renewal; stopping every sandbox of this node")
            if self.on_expiry is not None:
                try:
                    await self.on_expiry()
                except Exception:
                    log.exception("fencing this node's sandboxes failed")
