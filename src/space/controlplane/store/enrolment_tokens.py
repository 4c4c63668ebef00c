"""Node enrolment tokens (ADR 0021): secrets that let a new node enrol, a bounded number of times.

Invariants:
- Only the SHA-256 of a token is kept; its secret is answered once, by `create_enrolment_token`.
- A token is usable while uses < max_uses and it has not expired. A use is taken by one conditional
  UPDATE (`consume_enrolment`) inside the enrolling transaction, so concurrent enrolments never take
  more uses than the token has, and a refused enrolment takes none.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.orm import Session

from space.controlplane.store.database import Repository
from space.controlplane.store.digests import hash_secret, plausible_secret
from space.controlplane.store.models import EnrolmentToken
from space.controlplane.store.values import rowcount, seconds
from space.core.errors import InvalidArgument, Unauthenticated

MAX_USES = 10_000


def _usable(secret: str, now: datetime) -> list[ColumnElement[bool]]:
    return [
        EnrolmentToken.token_hash == hash_secret(secret),
        EnrolmentToken.uses < EnrolmentToken.max_uses,
        or_(EnrolmentToken.expires_at.is_(None), EnrolmentToken.expires_at > now),
    ]


def consume_enrolment(session: Session, secret: str, now: datetime) -> None:
    """Take one use of the enrolment token `secret` in `session`'s transaction; Unauthenticated if it is
    unknown, expired or used up."""
    used = session.execute(
        update(EnrolmentToken)
        .where(*_usable(secret, now))
        .values(uses=EnrolmentToken.uses + 1, last_used_at=now)
        .execution_options(synchronize_session=False)
    )
    if rowcount(used) != 1:
        raise Unauthenticated("bad node token")


class EnrolmentTokenRepository(Repository):
    """Issuing and checking enrolment tokens (their uses are taken by NodeRepository.enrol_node)."""

    def create_enrolment_token(self, *, uses: int = 1, ttl_s: float | None = None) -> tuple[str, str]:
        """(id, secret) of a new enrolment token good for `uses` enrolments (within `ttl_s` seconds if
        given). The secret is answered once; only its SHA-256 is kept."""
        if not isinstance(uses, int) or not 1 <= uses <= MAX_USES:
            raise InvalidArgument(f"uses must be 1 to {MAX_USES}", field="uses")
        now = self.now()
        expires = now + seconds(ttl_s, "ttl_s") if ttl_s is not None else None
        secret = "enrol_" + secrets.token_urlsafe(30)
        token_id = "enrol-" + secrets.token_hex(10)
        with self._tx("creating an enrolment token") as session:
            session.add(
                EnrolmentToken(
                    id=token_id, token_hash=hash_secret(secret), max_uses=uses, uses=0, expires_at=expires,
                    created_at=now, last_used_at=None,
                )
            )  # fmt: skip
        return token_id, secret

    def enrolment_token_usable(self, secret: str) -> bool:
        """Whether `secret` is an enrolment token with a use left (a check before a request body is read;
        the use itself is taken by enrol_node)."""
        if not plausible_secret(secret):
            return False
        with self._tx("checking an enrolment token") as session:
            found = session.scalars(select(EnrolmentToken.id).where(*_usable(secret, self.now()))).first()
            return found is not None
