"""Verb handlers for the node's network (registered in space.node.helper.verbs; the machinery is
space.node.helper.network).

Invariants:
- On a node whose sandboxes get no network, `network.info` answers `{"mode": "none"}` and every other
  network verb is refused as InvalidState, never half-applied.
"""

from __future__ import annotations

from typing import Any

from space.core import errors
from space.node.helper.context import HelperContext
from space.node.helper.network import SandboxNetworks
from space.node.helper.params import NetworkConfigureParams


def _require(ctx: HelperContext) -> SandboxNetworks:
    if ctx.network is None:
        raise errors.InvalidState("this node gives sandboxes no network (network = none)", state="none",
                                  event="network")  # fmt: skip
    return ctx.network


def verb_sandbox_network(ctx: HelperContext, params: Any, _progress: Any) -> dict[str, Any]:
    """Where a sandbox's traffic comes from, as the node's egress gateway sees it."""
    return _require(ctx).describe(params.sandbox_id)


def verb_network_info(ctx: HelperContext, _params: Any, _progress: Any) -> dict[str, Any]:
    if ctx.network is None:
        return {"mode": "none"}
    return ctx.network.info()


def verb_network_configure(
    ctx: HelperContext, params: NetworkConfigureParams, _progress: Any
) -> dict[str, Any]:
    """Set the egress gateway's ports (the node table is replaced atomically; effective at once)."""
    return _require(ctx).configure(params.ports)
