"""E2B's network rules (`PUT /sandboxes/{id}/network`) and metrics (`GET /sandboxes/{id}/metrics`).

Invariants:
- Network rules are SPACE's egress policy (`PUT /v1/sandboxes/{id}/egress`, the same code): E2B's
  `allowOut`/`denyOut` are its allow/deny lists, `allow_internet_access: false` denies every address, and the
  update replaces the whole configuration as E2B's does (a list left out is cleared). What SPACE's
  gateway cannot do (DNS servers, an egress proxy, per-host rules) is
  refused with 400 naming it.
- Metrics are SPACE's per-sandbox metrics history (`GET /v1/sandboxes/{id}/metrics`, the same code: a
  read-only key suffices, reading is passive), each sample as E2B's `SandboxMetric` (every field set: a
  figure the node does not know is 0).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import Field

from space.controlplane.api import egress as space_egress
from space.controlplane.api.bodies import EgressBody
from space.controlplane.api.deps import Svc
from space.controlplane.api.sandbox_metrics import sandbox_metrics
from space.controlplane.e2b.auth import E2bAuth
from space.controlplane.e2b.bodies import MAX_NETWORK_ENTRIES, Network, refuse_set
from space.controlplane.e2b.lookups import shown_sandbox
from space.controlplane.e2b.sandboxes import NO_INTERNET
from space.controlplane.e2b.views import rfc3339
from space.node.agent.metrics_models import MAX_SAMPLES, MAX_TIMESTAMP, MetricSample

router = APIRouter()


class NetworkUpdate(Network):
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers", max_length=MAX_NETWORK_ENTRIES)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: NetworkUpdate, who: E2bAuth, services: Svc) -> Response:
    who.require("member")
    body.refuse_unsupported()
    refuse_set({"dnsServers": body.dns_servers}, None)
    sb = await shown_sandbox(services, who, sandbox_id)
    deny = list(body.deny_out or [])
    if body.allow_internet_access is False:
        deny += [cidr for cidr in NO_INTERNET if cidr not in deny]
    # E2B replaces the whole configuration (a list left out is cleared); bound credentials are SPACE's.
    await space_egress.put_egress(sb.id, EgressBody(allow=body.allow_out or [], deny=deny), who, services)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(
    sandbox_id: str,
    who: E2bAuth,
    services: Svc,
    start: Annotated[int | None, Query(ge=0, le=int(MAX_TIMESTAMP))] = None,
    end: Annotated[int | None, Query(ge=0, le=int(MAX_TIMESTAMP))] = None,
) -> Any:
    sb = await shown_sandbox(services, who, sandbox_id)
    history = await sandbox_metrics(sb.id, who, services, start=start, end=end, limit=MAX_SAMPLES)
    return [_metric(sample) for sample in history.samples]


def _metric(sample: MetricSample) -> dict[str, Any]:
    at = datetime.fromtimestamp(sample.timestamp, UTC)
    return {
        "timestamp": rfc3339(at),
        "timestampUnix": int(sample.timestamp),
        "cpuCount": max(1, math.ceil(sample.cpu_count)),
        "cpuUsedPct": sample.cpu_used_pct,
        "memUsed": sample.mem_used_bytes,
        "memTotal": sample.mem_total_bytes,
        "memCache": sample.mem_cache_bytes or 0,
        "diskUsed": sample.disk_used_bytes or 0,
        "diskTotal": sample.disk_total_bytes,
    }
