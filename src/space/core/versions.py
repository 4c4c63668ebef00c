"""The SPACE release a process runs, as every component reports it: `space --version`, the control plane's
`/healthz`, a node's registration and heartbeats (so `space node list` and `space status` show it), and a
backup's manifest. One function, `space_version()`, so no two places can disagree (ADR 0079).

Invariants:
- The version is the installed package's (`space-sandbox`), unless `SPACE_VERSION_OVERRIDE` is set: an
  operator-invisible but documented override that only changes what this process *reports* (the upgrade
  tests restart a component "as N+1" with it; a packager may stamp a build). It changes no behaviour.
- A reported version is a short token (`VERSION_PATTERN`, at most MAX_LENGTH characters): an override that
  is not one is an InvalidArgument naming the variable (a process refuses to start rather than report
  something else), and a version a peer reports (`parse_reported`) that is not one is no report (None),
  never an error and never echoed.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Final

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from space.core import errors

OVERRIDE_ENV: Final = "SPACE_VERSION_OVERRIDE"
PACKAGE: Final = "space-sandbox"
UNKNOWN: Final = "0+unknown"  # a source tree that was never installed
MAX_LENGTH: Final = 64
VERSION_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")


def _is_version(value: str) -> bool:
    return 0 < len(value) <= MAX_LENGTH and VERSION_PATTERN.fullmatch(value) is not None


class _Override(BaseSettings):
    """The override, read from the environment as every setting of core is (pydantic-settings: core itself
    does no I/O)."""

    model_config = SettingsConfigDict(case_sensitive=True, extra="ignore")

    value: str | None = Field(default=None, validation_alias=OVERRIDE_ENV)


def space_version() -> str:
    """What this process reports as its SPACE version (see the module invariants)."""
    try:
        override = _Override().value
    except ValidationError as exc:  # (it is a string whatever it holds; kept for safety)
        raise errors.InvalidArgument(f"{OVERRIDE_ENV}: {exc}", field=OVERRIDE_ENV) from exc
    if override:
        if not _is_version(override):
            raise errors.InvalidArgument(
                f"{OVERRIDE_ENV} must be 1 to {MAX_LENGTH} characters of [A-Za-z0-9.+_-] starting with a "
                "letter or digit",
                field=OVERRIDE_ENV,
            )
        return override
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def parse_reported(raw: object) -> str | None:
    """A version a peer reports about itself (a node's heartbeat): the value if it is a version, else None
    (absent from older agents, or not to be trusted)."""
    return raw if isinstance(raw, str) and _is_version(raw) else None
