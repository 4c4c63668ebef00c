"""How the node's egress gateway is configured: the operator's settings (ports, resolver, trust store,
networks only the operator may open) and an egress policy as callers send it.

Invariants:
- Operator settings come from the operator's file, never from a tenant; a malformed file is an
  InvalidArgument naming the file (the agent does not start with a half-read configuration).
- A policy that fails validation is an InvalidArgument on the field `egress`.
- On a node with a control plane, a policy sent without `private_networks` opens no private range at all
  (`approvals_required`): only what an org admin approved (ADR 0026) is ever opened.
"""

from __future__ import annotations

import ipaddress
import json
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from space.core import errors
from space.node.egress import CredentialSource, EgressPolicy, Resolver, StaticResolver
from space.node.egress.policy import IPNetwork

#: Where the gateway listens on the node's gateway address. Fixed (not "any free port") because the proxy
#: port is part of every sandbox's environment, which must stay right across agent restarts and nodes.
DEFAULT_PORTS: dict[str, int] = {
    "proxy": 3128,
    "transparent_http": 3080,
    "transparent_tls": 3443,
    "dns": 3053,
}


class EgressRequest(BaseModel):
    """An egress policy as callers send it (create request, policy push): domains/CIDRs + a version."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=list)
    deny: list[str] = Field(default_factory=list)
    version: int = Field(default=0, ge=0)
    # What an org admin approved for the project (from the control plane; ADR 0026). None: not sent.
    private_networks: list[str] | None = None

    def policy(self, *, approvals_required: bool = False) -> EgressPolicy:
        """The gateway's policy. `approvals_required` (a node with a control plane): a policy that came
        without `private_networks` opens no private range at all."""
        private = self.private_networks
        if private is None and approvals_required:
            private = []
        try:
            return EgressPolicy(allow=self.allow, deny=self.deny, private_networks=private)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise errors.InvalidArgument(f"egress policy: {first.get('msg')}", field="egress") from exc


@dataclass
class EgressSettings:
    """How the node's gateway is set up (operator configuration, never a tenant's)."""

    state_dir: pathlib.Path  # the CA key and recorded policies; owned by the agent's user, mode 0700
    ports: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    resolver: Resolver | None = None  # default: the node's own resolver
    trust_store: pathlib.Path | None = None  # upstream certificates; default: the system store
    operator_allowed_networks: Sequence[IPNetwork] = ()
    credentials: CredentialSource | None = None  # node-only use; with a control plane it is the CP's


def load_settings(state_dir: pathlib.Path, config: pathlib.Path | None) -> EgressSettings:
    """EgressSettings from an operator's JSON file (all keys optional):
    {"ports": {"proxy", "transparent_http", "transparent_tls", "dns"}, "hosts": {name: [address, ...]},
     "trust_store": "/path/ca.pem", "allow_networks": ["CIDR", ...]}. `hosts` replaces the system resolver
    (air-gapped nodes, tests); `allow_networks` opens ranges that are otherwise never reachable."""
    settings = EgressSettings(state_dir=state_dir)
    if config is None:
        return settings
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise errors.InvalidArgument(f"egress config {config}: {exc}", field="egress_config") from exc
    if not isinstance(raw, dict):
        raise errors.InvalidArgument(f"egress config {config} is not a JSON object", field="egress_config")
    try:
        if "ports" in raw:
            settings.ports = {**DEFAULT_PORTS, **{str(k): int(v) for k, v in raw["ports"].items()}}
        if "hosts" in raw:
            settings.resolver = StaticResolver({str(k): [str(a) for a in v] for k, v in raw["hosts"].items()})
        if raw.get("trust_store"):
            settings.trust_store = pathlib.Path(str(raw["trust_store"]))
        settings.operator_allowed_networks = [
            ipaddress.ip_network(str(n)) for n in raw.get("allow_networks") or []
        ]
    except (AttributeError, TypeError, ValueError) as exc:
        raise errors.InvalidArgument(f"egress config {config}: {exc}", field="egress_config") from exc
    return settings
