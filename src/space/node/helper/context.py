"""What every verb handler of the root helper receives, and what the verb table is made of.

This module sits below every handler module (sandbox_verbs, snapshot_verbs, template_verbs, node_verbs,
network_verbs, transfer, storage) and above the machinery they drive (runtime, network, runsc), so the
handlers and the table (space.node.helper.verbs) depend on it and it depends on none of them.

Invariants:
- One HelperContext per helper process; it owns the per-sandbox (and per-template) locks that serialise
  verbs on one sandbox, and the Runtimes that know each sandbox's current container.
- `network` is None exactly when the node gives sandboxes no network (NodeSettings.network = none).
- A Verb pairs a name with its parameter model (space.node.helper.params: extra fields forbidden, strict,
  frozen) and its handler; `sandbox_scoped` verbs run under the sandbox's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from space.node.helper.network import SandboxNetworks
from space.node.helper.runsc import Runsc
from space.node.helper.runtime import Runtimes
from space.node.layout import NodeLayout

Progress = Callable[[str], None]


@dataclass
class HelperContext:
    layout: NodeLayout
    runsc: Runsc
    owner_uid: int
    cgroup_parent: str = "space"
    network: SandboxNetworks | None = None  # None: sandboxes get no network (NodeSettings.network)
    favor_cgroup_moves: bool = True  # node.prepare asks the kernel for cheap cgroup moves (ADR 0086)
    runtimes: Runtimes = field(init=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.runtimes = Runtimes(self.layout, self.runsc, self.owner_uid, self.cgroup_parent)
        self.runtimes.network = self.network

    def lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())


Handler = Callable[[HelperContext, Any, Progress], dict[str, Any]]


@dataclass(frozen=True)
class Verb:
    name: str
    params: type[BaseModel]  # a model of space.node.helper.params
    handler: Handler
    sandbox_scoped: bool = False
