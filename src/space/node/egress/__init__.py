"""The node's egress gateway: per-sandbox policy, DNS, TLS interception and credential injection.

See docs/adr/0016-egress-gateway.md. Public names: EgressGateway, EgressPolicy, Credential,
CredentialSource, Resolver (and the static/system implementations used by tests and single-node setups).

Invariants (detailed in each module): no policy means no egress; a credential value is written only into
requests to hosts bound to it, and scrubbed from their responses; a sandbox is known only by its source
address.
"""

from space.node.egress.credentials import Credential, CredentialSource, StaticCredentials, make_placeholder
from space.node.egress.dns import Resolver, StaticResolver, SystemResolver
from space.node.egress.gateway import EgressGateway
from space.node.egress.policy import CompiledPolicy, Decision, Destination, EgressPolicy, normalize_host

__all__ = [
    "CompiledPolicy",
    "Credential",
    "CredentialSource",
    "Decision",
    "Destination",
    "EgressGateway",
    "EgressPolicy",
    "Resolver",
    "StaticCredentials",
    "StaticResolver",
    "SystemResolver",
    "make_placeholder",
    "normalize_host",
]
