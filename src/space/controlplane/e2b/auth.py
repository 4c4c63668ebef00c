"""Who calls the E2B front: a SPACE API key sent the way E2B's clients send theirs.

Invariants:
- E2B's SDKs send `X-API-Key: <key>` (no scheme); `Authorization: Bearer <key>` works too (SPACE's own
  clients, E2B's CLI). With both, `Authorization` wins, exactly as on SPACE's own API.
- The key is checked by the same code as SPACE's API (`deps.authenticate`: the same cache bounds on a
  revoked key, the same org/project resolution with `X-Space-Project`), so roles and revocation are
  SPACE's.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from space.controlplane.api.deps import Principal, Services, authenticate, services_of


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
    return await e2b_principal(services_of(request), authorization, x_api_key, x_space_project)


#: The caller of an E2B route (401 in E2B's shape without a valid key).
E2bAuth = Annotated[Principal, Depends(_principal)]
