"""Who calls the E2B front: a SPACE API key sent the way E2B's clients send theirs.

Invariants:
- E2B's SDKs send `X-API-Key: <key>` (no scheme); `Authorization: Bearer <key>` works too (SPACE's own
  clients, E2B's CLI). With both, `Authorization` wins, exactly as on SPACE's own API.
- The key is checked by the same code as SPACE's API (`deps.authenticate`: the same cache bounds on a
  revoked key, the same org/project resolution with `X-Space-Project`), so roles and revocation are
  SPACE's.
- An app that keeps `state.request_buckets` (the control app does) rate-limits each key as SPACE's API
  does (`SPACE_API_REQUESTS_PER_S`, `SPACE_API_REQUEST_BURST`; 429 with Retry-After, which E2B's SDK
  honours), in buckets of its own.
"""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Depends, Header, Request

from space.controlplane.api.deps import Principal, Services, authenticate, services_of
from space.controlplane.api.limits import TokenBuckets
from space.core import errors


def authorization_of(authorization: str | None, x_api_key: str | None) -> str | None:
    """The `Authorization` value to authenticate: the header itself, else `X-API-Key` as a bearer key."""
    if authorization:
        return authorization
    if x_api_key and x_api_key.strip():
        return "Bearer " + x_api_key.strip()
    return None


async def e2b_principal(
    services: Services, authorization: str | None, x_api_key: str | None, x_space_project: str | None
) -> Principal:
    return await authenticate(services, authorization_of(authorization, x_api_key), x_space_project)


async def _principal(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
    x_space_project: Annotated[str | None, Header()] = None,
) -> Principal:
    services = services_of(request)
    who = await e2b_principal(services, authorization, x_api_key, x_space_project)
    buckets: TokenBuckets | None = getattr(request.app.state, "request_buckets", None)
    if buckets is not None:
        wait_s = buckets.take(who.key.id)
        if wait_s > 0:
            raise errors.ResourceExhausted(
                f"too many requests for this API key (limit {services.settings.api_requests_per_s:g}/s): "
                f"retry after {math.ceil(wait_s)} s",
                limit="requests_per_s", retry_after_s=math.ceil(wait_s),
            )  # fmt: skip
    return who


#: The caller of an E2B route (401 in E2B's shape without a valid key).
E2bAuth = Annotated[Principal, Depends(_principal)]
