"""What the node agent knows of one sandbox: its handle (spec, lifecycle state, channel, snapshots, lock) and
the records of its snapshots.

Invariants:
- `state` changes only through space.core.lifecycle.transition (the agent's step runner, or `_lost`).
- Operations on one sandbox are serialised by its `lock`; different sandboxes proceed in parallel.
- A channel that ends without the node closing it means the runtime died: a live sandbox that no step
  holds goes to `crashed` (a step in flight owns the state and settles it itself).
- `session` is only handed out over an open channel: anything else is InvalidState naming the state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from space.core import errors
from space.core.lifecycle import LIVE_STATES, Event, State, transition
from space.node.agent.channel import GuestChannel
from space.node.agent.guest import GuestSession
from space.node.drivers.base import SandboxSpec

log = logging.getLogger("space.node.agent.agent")


@dataclass
class SnapshotRecord:
    snapshot_id: str
    kind: str  # "disk" | "full"
    created_at: float
    image_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class SandboxHandle:
    sandbox_id: str
    spec: SandboxSpec
    state: State
    created_at: float
    channel: GuestChannel | None = None
    snapshots: dict[str, SnapshotRecord] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    crashed_at: float | None = None
    #: The checkpoint a suspended sandbox is paused at (set when its suspend completed on this node).
    suspended_at: str | None = None
    #: How a create made it here: "pool", "warm" or "cold" (None: not made by a create of this agent).
    created_from: Literal["pool", "warm", "cold"] | None = None
    #: The daemon process id of the template's start command this create started (space.node.agent.
    #: template_start), and why it failed to start or run (None: it did not fail, or there was none).
    start_process: str | None = None
    start_error: str | None = None

    def attach(self, channel: GuestChannel | None) -> None:
        """Adopt a new channel; if it ends without the node closing it, the runtime died: `crash`."""
        self.channel = channel
        if channel is not None:
            channel.on_lost = lambda reason: self._lost(channel, reason)

    def _lost(self, channel: GuestChannel, reason: str) -> None:
        if channel is not self.channel:
            return  # a channel we already replaced
        if self.state in LIVE_STATES and not self.lock.locked():
            log.warning("sandbox %s lost its runtime (%s): crashed", self.sandbox_id, reason)
            self.state = transition(self.state, Event.CRASH)
            self.crashed_at = time.time()

    @property
    def session(self) -> GuestSession:
        if self.channel is None or self.channel.closed:
            raise errors.InvalidState(
                f"sandbox {self.sandbox_id} has no running processes (state '{self.state}')",
                state=str(self.state),
            )
        return GuestSession(self.channel)
