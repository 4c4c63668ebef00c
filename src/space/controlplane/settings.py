"""Every tunable of the control plane in one place: `ControlPlaneSettings`, read from the environment.

Invariants:
- This is the only module of the control plane that reads its environment variables; each is named by
  the `validation_alias` of exactly one field, matched case-sensitively, and documented on that field.
- Names that existed before this class keep their meaning: `SPACE_API_*` (request limits, ADR 0025),
  `SPACE_NODE_POOL_*` (node connection pools, ADR 0025), `SPACE_RETENTION_*` (ADR 0025), `SPACE_STORE_URL`,
  `SPACE_KEYS_DIR`, `SPACE_SNAPSHOT_MIN_INTERVALS`, `SPACE_E2B_API_LISTEN`, `SPACE_E2B_SANDBOX_LISTEN`
  (defaults of the server's flags, which still win), `SPACE_KMS_URL` (ADR 0018) and `SPACE_FAILPOINTS`
  (tests only). A numeric variable that is unset or blank means the default; any other value must be a
  positive number (else `errors.InvalidArgument`, naming it).
- A control plane reads them once, in `create_app` (`from_env`), and hands them to its parts through
  `Services.settings`. Kill points for crash injection are not settings: `space.faults.failpoints` reads its
  own environment variables, in every component alike (ADR 0038).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUseDefault
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from space.core import errors

GiB = 1 << 30
MiB = 1 << 20

#: The environment `from_env` reads (None: the process's own).
_environ: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("environ", default=None)


class _Environment(EnvSettingsSource):
    """The process environment, or the mapping handed to `ControlPlaneSettings.from_env`."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        environ = _environ.get()
        return parse_env_vars(
            os.environ if environ is None else environ,
            self.case_sensitive,
            self.env_ignore_empty,
            self.env_parse_none_str,
        )


def _positive(default: float, alias: str, doc: str) -> Any:
    return Field(default=default, gt=0, validation_alias=alias, description=doc)


class ControlPlaneSettings(BaseSettings):
    """The control plane's tunables; each field's environment variable is its alias."""

    model_config = SettingsConfigDict(case_sensitive=True, frozen=True, extra="ignore")

    # -- process (the server's flags default to these) -------------------------------------------------------
    store_url: str | None = Field(
        default=None, validation_alias="SPACE_STORE_URL",
        description="Default of --store-url: the object store shared with the nodes (suspend, restore, "
        "uploads); None: suspend is refused.",
    )  # fmt: skip
    keys_dir: str | None = Field(
        default=None, validation_alias="SPACE_KEYS_DIR",
        description="Default of --keys-dir: the embedded key service's directory (None: DATA_DIR/keys).",
    )  # fmt: skip
    snapshot_min_intervals: str = Field(
        default="60,300", validation_alias="SPACE_SNAPSHOT_MIN_INTERVALS",
        description="Default of --snapshot-min-intervals: DISK,FULL, the shortest disk_every_s and "
        "full_every_s a snapshot policy may ask for (ADR 0027).",
    )  # fmt: skip
    kms_url: str | None = Field(
        default=None, validation_alias="SPACE_KMS_URL",
        description="kms://?endpoint=...&region=...: orgs may register KMS keys (BYOK, ADR 0018).",
    )  # fmt: skip
    e2b_api_listen: str | None = Field(
        default=None, validation_alias="SPACE_E2B_API_LISTEN",
        description="Default of --e2b-api-listen: HOST:PORT of E2B's control API (space.controlplane.e2b; "
        "None: not served). `space up` turns it on.",
    )  # fmt: skip
    e2b_sandbox_listen: str | None = Field(
        default=None, validation_alias="SPACE_E2B_SANDBOX_LISTEN",
        description="Default of --e2b-sandbox-listen: HOST:PORT of E2B's in-sandbox API, at the root of its "
        "own port (None: not served). `space up` turns it on.",
    )  # fmt: skip

    # -- request limits of the public API (api/limits.py, ADR 0025) -----------------------------------------
    api_json_body_bytes: int = _positive(MiB, "SPACE_API_JSON_BODY_BYTES", "Bodies of JSON routes.")
    api_upload_body_bytes: int = _positive(8 * GiB, "SPACE_API_UPLOAD_BODY_BYTES", "File uploads, stdin.")
    api_node_body_bytes: int = _positive(
        4 * MiB, "SPACE_API_NODE_BODY_BYTES", "Bodies of node-facing routes (heartbeats, audit batches)."
    )
    api_requests_per_s: float = _positive(100.0, "SPACE_API_REQUESTS_PER_S", "Sustained requests per key.")
    api_request_burst: int = _positive(
        200, "SPACE_API_REQUEST_BURST", "Requests a key may make at once after a quiet spell."
    )
    api_streams_per_key: int = _positive(
        32,
        "SPACE_API_STREAMS_PER_KEY",
        "Concurrent long-lived operations (exec, output, files, PTY) per key.",
    )
    api_send_stall_s: float = _positive(
        300.0, "SPACE_API_SEND_STALL_S", "A client that takes no chunk of a stream for this long is cut off."
    )
    api_max_tracked_keys: int = _positive(
        100_000, "SPACE_API_MAX_TRACKED_KEYS", "Rate buckets kept in memory (idle ones are dropped first)."
    )

    # -- the API's own timings and caches (api/deps.py) -----------------------------------------------------
    wait_timeout_s: float = _positive(
        120.0, "SPACE_API_WAIT_TIMEOUT_S", "How long a request waits for its sandbox to settle."
    )
    idempotency_stale_s: float = _positive(
        3.0, "SPACE_API_IDEMPOTENCY_STALE_S",
        "An in-progress idempotent request not heard of for this long died with its process.",
    )  # fmt: skip
    auth_cache_s: float = _positive(
        5.0, "SPACE_API_AUTH_CACHE_S", "A revoked key keeps working at most this long on other replicas."
    )
    running_cache_s: float = _positive(
        1.0, "SPACE_API_RUNNING_CACHE_S",
        "How long a data-plane request trusts that a sandbox it saw running still is.",
    )  # fmt: skip
    activity_debounce_s: float = _positive(
        1.0, "SPACE_API_ACTIVITY_DEBOUNCE_S", "At most one activity write per sandbox in this time."
    )
    max_upload_bytes: int = _positive(
        8 * GiB, "SPACE_API_MAX_UPLOAD_BYTES", "The relay's own cap on any one body sent to a node."
    )
    small_body_bytes: int = _positive(
        64 << 10,
        "SPACE_API_SMALL_BODY_BYTES",
        "Relayed bodies up to this size are passed whole, not streamed.",
    )
    credential_purge_interval_s: float = _positive(
        600.0, "SPACE_CREDENTIAL_PURGE_INTERVAL_S", "Expired credentials are purged at most this often."
    )
    node_lost_after_s: float = _positive(
        15.0, "SPACE_NODE_LOST_AFTER_S", "A node without a heartbeat for this long is marked lost."
    )
    fence_grace_s: float = _positive(
        3.0, "SPACE_FENCE_GRACE_S",
        "A node fences itself this long before it could be marked lost: the heartbeat answer grants a "
        "lease of node_lost_after_s minus this (ADR 0033). Covers the node's teardown, clock-rate drift "
        "and the replicas' clock offset; must stay below node_lost_after_s.",
    )  # fmt: skip
    leader_lease_s: float = _positive(
        10.0, "SPACE_LEADER_LEASE_S",
        "How long a replica's leadership of the once-per-cluster jobs lasts unless renewed (renewed every "
        "third of it); a dead leader's jobs move to another replica within this (ADR 0034).",
    )  # fmt: skip

    @model_validator(mode="after")
    def _fence_before_lost(self) -> ControlPlaneSettings:
        if self.fence_grace_s >= self.node_lost_after_s:
            raise ValueError("SPACE_FENCE_GRACE_S must be less than SPACE_NODE_LOST_AFTER_S")
        return self

    @property
    def fence_after_s(self) -> float:
        """The lease a heartbeat answer grants: the node stops its sandboxes this long after it SENT the
        heartbeat, `fence_grace_s` before any replica may mark it lost (ADR 0033)."""
        return self.node_lost_after_s - self.fence_grace_s

    # -- connection pools to the nodes (node_pools.py, ADR 0025) ---------------------------------------------
    pool_control_connections: int = _positive(
        64, "SPACE_NODE_POOL_CONTROL_CONNECTIONS", "Per node, for the reconciler and lifecycle calls."
    )
    pool_control_total_s: float = _positive(
        900.0,
        "SPACE_NODE_POOL_CONTROL_TOTAL_S",
        "A control call (request and whole answer) ends within this.",
    )
    pool_control_max_json_bytes: int = _positive(
        64 * MiB, "SPACE_NODE_POOL_CONTROL_MAX_JSON_BYTES", "Largest JSON answer of a control call."
    )
    pool_data_connections: int = _positive(
        512, "SPACE_NODE_POOL_DATA_CONNECTIONS", "Per node, shared by every tenant."
    )
    pool_data_per_owner: int = _positive(
        48, "SPACE_NODE_POOL_DATA_PER_OWNER", "Calls in flight per API key per node."
    )
    pool_data_wait_s: float = _positive(
        10.0, "SPACE_NODE_POOL_DATA_WAIT_S", "Longest wait for a slot or a pooled connection before a 429."
    )
    pool_data_idle_s: float = _positive(
        3600.0, "SPACE_NODE_POOL_DATA_IDLE_S", "A data call whose node sends nothing for this long is closed."
    )
    pool_data_max_json_bytes: int = _positive(
        8 * MiB, "SPACE_NODE_POOL_DATA_MAX_JSON_BYTES", "Largest JSON answer the gateway relays whole."
    )
    pool_sockets: str = Field(
        default="", validation_alias="SPACE_NODE_POOL_SOCKETS",
        description="URL=PATH,...: the node registered at URL is reached through the unix socket PATH (its "
        "agent's --listen-socket, on this machine; ADR 0044). Only the operator names sockets, never a node.",
    )  # fmt: skip
    nodes_ca_file: str | None = Field(
        default=None, max_length=4096, validation_alias="SPACE_NODES_CA_FILE",
        description="PEM CA bundle that verifies the certificates of nodes registered at https URLs (unset: "
        "the system trust store); http node URLs are called as they are (ADR 0079).",
    )  # fmt: skip

    # -- retention of rows that only grow (retention.py, ADR 0025) -------------------------------------------
    retention_idempotency_s: float = _positive(
        24 * 3600.0, "SPACE_RETENTION_IDEMPOTENCY_S", "Idempotency records are kept (and replayed) this long."
    )
    retention_audit_s: float = _positive(
        30 * 24 * 3600.0, "SPACE_RETENTION_AUDIT_S", "Credential audit entries are kept this long."
    )
    retention_batch: int = _positive(1000, "SPACE_RETENTION_BATCH", "Rows deleted per transaction.")
    retention_max_batches: int = _positive(
        50, "SPACE_RETENTION_MAX_BATCHES", "Batches per purge run (the next run goes on)."
    )

    @field_validator("*", mode="before")
    @classmethod
    def _blank_is_default(cls, value: Any, info: Any) -> Any:
        """A blank numeric variable means the default, as it always did; text settings stay as given."""
        if isinstance(value, str) and info.field_name in _NUMERIC:
            if not value.strip():
                raise PydanticUseDefault()
            return value.strip()
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments, then the environment: no .env files, no secret directories.
        return init_settings, _Environment(settings_cls)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, only: str | None = None
    ) -> ControlPlaneSettings:
        """The settings of `environ` (default: this process's environment), or with `only` just that
        field's (the others at their defaults); a bad value is InvalidArgument naming its variable."""
        if only is not None:
            source = os.environ if environ is None else environ
            name = cls.env_name(only)
            environ = {name: source[name]} if name in source else {}
        token = _environ.set(environ)
        try:
            return cls()
        except ValidationError as exc:
            problem = exc.errors()[0]
            name = str(problem["loc"][0]) if problem["loc"] else "?"
            raise errors.InvalidArgument(f"{name}={problem.get('input')!r}: {problem['msg']}") from exc
        finally:
            _environ.reset(token)

    @classmethod
    def env_name(cls, field_name: str) -> str:
        alias = cls.model_fields[field_name].validation_alias
        assert isinstance(alias, str)
        return alias


_NUMERIC = frozenset(
    name for name, info in ControlPlaneSettings.model_fields.items() if info.annotation in (int, float)
)


def default_of(field_name: str) -> Any:
    """A field's default (for the groups that components take: LimitSettings, PoolSettings, ...)."""
    return ControlPlaneSettings.model_fields[field_name].default
