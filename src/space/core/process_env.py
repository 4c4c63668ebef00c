"""The process-wide settings a starter passes on to every SPACE process it starts (`space up`: the control
plane, the helper, the agent; `space node join`: the helper and the agent), so that one variable set for the
starter logs, traces and reports alike in all of them (ADR 0071, 0072, 0079).

Invariants:
- `PASSED_ON` is the one list: how lines are written (SPACE_LOG_FORMAT), tracing (SPACE_TRACING,
  SPACE_TRACE_*, the OTLP exporter's variables) and the reported version (SPACE_VERSION_OVERRIDE). None of
  them is a secret (the OTLP headers may hold a collector's token: they go only to SPACE's own processes,
  as the operator set them).
- `passed_on(environ)` copies only the variables that are set; a starter adds them to the fixed environment
  it builds for its children, never the whole of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from space.core.tracing import TRACING_ENV
from space.core.versions import OVERRIDE_ENV

LOG_FORMAT_ENV: Final = "SPACE_LOG_FORMAT"
PASSED_ON: Final = (LOG_FORMAT_ENV, OVERRIDE_ENV, *TRACING_ENV)


def passed_on(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of PASSED_ON that `environ` sets."""
    return {name: environ[name] for name in PASSED_ON if name in environ}
