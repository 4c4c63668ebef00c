"""A SPACE process's logging, set once at its start: the format from SPACE_LOG_FORMAT (text by default, json
for the systemd services; space.rest.log_records), and uvicorn's own loggers in the same format.

Invariants:
- With json, uvicorn is given no logging configuration of its own (`uvicorn_log_config()` is None): its
  records propagate to the root handler, so every line of the process is one JSON object. With text,
  uvicorn keeps its usual lines.
- A bad SPACE_LOG_FORMAT is an InvalidArgument naming the variable (the entry point reports it), never a
  silent fallback; so is a bad SPACE_VERSION_OVERRIDE (space.core.versions).
- A process's first line names the SPACE version it runs (what it reports to its peers: ADR 0079), so an
  upgrade can be read from the logs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from space.core import versions
from space.rest.log_records import LOG_FORMAT_ENV, LogFormat, configure, parse_format

_configured: list[LogFormat] = []


def configure_process_logging(
    component: str, level: str | int = "INFO", *, env: Mapping[str, str] | None = None
) -> LogFormat:
    """Configure the root logger of this process for `component`; returns the format chosen."""
    log_format = parse_format((os.environ if env is None else env).get(LOG_FORMAT_ENV))
    version = versions.space_version()
    configure(component, level=level, log_format=log_format, stream=sys.stderr)
    _configured[:] = [log_format]
    logging.getLogger(__name__).info("SPACE %s starting (%s)", version, component)
    return log_format


def uvicorn_log_config() -> dict[str, Any] | None:
    """What to pass uvicorn as `log_config`: None under JSON logs (its records reach the root handler),
    else uvicorn's default configuration."""
    if _configured and _configured[0] == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
