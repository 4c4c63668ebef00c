"""Orgs, projects and their API keys: who may call the control plane, and for which project.

Invariants:
- Names are 1 to 128 characters, unique per org (projects) and globally (orgs).
- An API key is `space_` + 240 random bits, or in E2B's shape `e2b_` + the same bits in hex (digests.py);
  both shapes are the same kind of key. Its secret is answered once, by `create_api_key`, and never
  stored: only its SHA-256 digest (looked up by a unique index) and a 12-character display prefix.
- A project key belongs to a project of its own org; an org key (project_id None) to no project.
- Revocation is final and idempotent: the first revocation time is kept; a revoked key authenticates
  nothing.
"""

from __future__ import annotations

from typing import Final, get_args

from sqlalchemy import select

from space.controlplane.store.database import Repository
from space.controlplane.store.digests import (
    API_KEY_DISPLAY_CHARS,
    API_KEY_PREFIXES,
    MAX_SECRET_LENGTH,
    KeyShape,
    hash_secret,
    matches,
    new_api_key_secret,
)
from space.controlplane.store.mapping import api_key_record, org_record, project_record
from space.controlplane.store.models import ApiKey, Org, Project
from space.controlplane.store.records import ApiKeyRecord, OrgRecord, ProjectRecord, Role
from space.controlplane.store.values import text
from space.core import ids
from space.core.errors import InvalidArgument, NotFound

_ROLES: Final = frozenset(get_args(Role))
NAME_LENGTH: Final = 128


class ProjectRepository(Repository):
    """Orgs and their projects."""

    def create_org(self, name: str) -> OrgRecord:
        name = text(name, "name", NAME_LENGTH)
        row = Org(id=ids.new_org_id(), name=name, created_at=self.now())
        with self._tx(f"creating org {name!r}") as session:
            session.add(row)
        return org_record(row)

    def get_org(self, org_id: str) -> OrgRecord | None:
        with self._tx("reading an org") as session:
            row = session.get(Org, org_id)
            return org_record(row) if row else None

    def get_org_by_name(self, name: str) -> OrgRecord | None:
        with self._tx("reading an org") as session:
            row = session.scalars(select(Org).where(Org.name == name)).one_or_none()
            return org_record(row) if row else None

    def create_project(self, org_id: str, name: str) -> ProjectRecord:
        name = text(name, "name", NAME_LENGTH)
        row = Project(id=ids.new_project_id(), org_id=org_id, name=name, created_at=self.now())
        with self._tx(f"creating project {name!r}") as session:
            session.add(row)
        return project_record(row)

    def get_project(self, project_id: str) -> ProjectRecord | None:
        with self._tx("reading a project") as session:
            row = session.get(Project, project_id)
            return project_record(row) if row else None

    def get_project_by_name(self, org_id: str, name: str) -> ProjectRecord | None:
        with self._tx("reading a project") as session:
            query = select(Project).where(Project.org_id == org_id, Project.name == name)
            row = session.scalars(query).one_or_none()
            return project_record(row) if row else None

    def list_projects(self, org_id: str) -> list[ProjectRecord]:
        with self._tx("listing projects") as session:
            query = select(Project).where(Project.org_id == org_id).order_by(Project.created_at, Project.id)
            return [project_record(row) for row in session.scalars(query)]


class ApiKeyRepository(Repository):
    """API keys of orgs and projects."""

    def create_api_key(
        self, project_id: str | None, org_id: str, role: Role, *, shape: KeyShape = "space"
    ) -> tuple[ApiKeyRecord, str]:
        """A new key and its secret (in `shape`). The secret is returned here once and never stored."""
        if role not in _ROLES:
            raise InvalidArgument(f"invalid role {role!r}: expected one of {sorted(_ROLES)}", field="role")
        if shape not in ("space", "e2b"):
            raise InvalidArgument(f"invalid key shape {shape!r}: expected space or e2b", field="shape")
        secret = new_api_key_secret(shape)
        row = ApiKey(
            id=ids.new_api_key_id(),
            project_id=project_id,
            org_id=org_id,
            role=role,
            key_hash=hash_secret(secret),
            prefix=secret[:API_KEY_DISPLAY_CHARS],
            created_at=self.now(),
            revoked_at=None,
        )
        with self._tx("creating an API key") as session:
            if project_id is not None:
                project = session.get(Project, project_id)
                if project is None or project.org_id != org_id:
                    raise NotFound(f"project {project_id} not found in org {org_id}")
            session.add(row)
        return api_key_record(row), secret

    def authenticate(self, secret: str) -> ApiKeyRecord | None:
        """The live key whose secret this is, or None (unknown, malformed or revoked)."""
        if (
            not isinstance(secret, str)
            or not secret.startswith(API_KEY_PREFIXES)
            or len(secret) > MAX_SECRET_LENGTH
        ):
            return None
        digest = hash_secret(secret)
        with self._tx("authenticating an API key") as session:
            row = session.scalars(select(ApiKey).where(ApiKey.key_hash == digest)).one_or_none()
            # The lookup is by a digest of a 240-bit secret, which leaks nothing useful through timing;
            # the final comparison is constant-time anyway so the rule "compare secrets with
            # compare_digest" holds without exceptions.
            if row is None or not matches(row.key_hash, secret) or row.revoked_at is not None:
                return None
            return api_key_record(row)

    def get_api_key(self, key_id: str) -> ApiKeyRecord | None:
        with self._tx("reading an API key") as session:
            row = session.get(ApiKey, key_id)
            return api_key_record(row) if row else None

    def list_api_keys(self, org_id: str, project_id: str | None = None) -> list[ApiKeyRecord]:
        with self._tx("listing API keys") as session:
            query = select(ApiKey).where(ApiKey.org_id == org_id)
            if project_id is not None:
                query = query.where(ApiKey.project_id == project_id)
            rows = session.scalars(query.order_by(ApiKey.created_at, ApiKey.id))
            return [api_key_record(row) for row in rows]

    def revoke_key(
        self, key_id: str, *, org_id: str | None = None, project_id: str | None = None
    ) -> ApiKeyRecord:
        """Revoke a key (idempotent: the first revocation time is kept). With org_id/project_id, a key
        outside that scope is NotFound, like an absent one."""
        with self._tx("revoking an API key") as session:
            row = session.get(ApiKey, key_id, with_for_update=True)
            if (
                row is None
                or (org_id is not None and row.org_id != org_id)
                or (project_id is not None and row.project_id != project_id)
            ):
                raise NotFound(f"API key {key_id} not found")
            if row.revoked_at is None:
                row.revoked_at = self.now()
            return api_key_record(row)
