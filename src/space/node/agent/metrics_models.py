"""The wire shape of a sandbox's metrics history, the same on the node RPC and the public API (the control
plane relays it as it is): `GET /node/v1/sandboxes/{id}/metrics` and `GET /v1/sandboxes/{id}/metrics`.

Invariants:
- A window is `start <= timestamp <= end` in Unix seconds, both finite, within [0, MAX_TIMESTAMP], and
  `start <= end` (checked by `check_window`: InvalidArgument naming the field otherwise).
- An answer holds at most `limit` samples (at most MAX_SAMPLES), oldest first: the newest ones of the
  window; `truncated` says older ones of the window were left out.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from space.core import errors

#: The most samples one answer holds (and the default of `limit`).
MAX_SAMPLES = 1000
#: The largest timestamp a window may name (the end of year 9999, UTC).
MAX_TIMESTAMP = 253402300799.0


class MetricSample(BaseModel):
    """One sample: CPU use since the previous sample, memory and disk at `timestamp`."""

    model_config = ConfigDict(frozen=True)

    timestamp: float = Field(description="Unix time of the reading, seconds")
    cpu_count: float = Field(description="The sandbox's CPU limit, in cores")
    cpu_used_pct: float = Field(
        description="CPU time used since the previous sample, in percent of the CPU limit (100: all of it)"
    )
    mem_used_bytes: int = Field(description="Memory charged to the sandbox (application kernel included)")
    mem_total_bytes: int = Field(description="The sandbox's memory limit")
    mem_cache_bytes: int | None = Field(description="Of mem_used_bytes, page cache; null when unknown")
    disk_used_bytes: int | None = Field(
        description="What the sandbox keeps on its node (files, snapshots, checkpoint images; ADR 0027), "
        "as of the filesystem's last commit; null when the node has no accounting"
    )
    disk_total_bytes: int = Field(description="The sandbox's storage budget")


class MetricsAnswer(BaseModel):
    sandbox_id: str
    interval_s: float | None = Field(
        description="How often the node samples a running sandbox; null when no node holds the sandbox"
    )
    samples: list[MetricSample]
    truncated: bool = Field(description="Older samples of the window were left out (see `limit`)")


def check_window(start: float | None, end: float | None) -> None:
    """InvalidArgument unless start and end (Unix seconds, either may be absent) make a window."""
    for name, value in (("start", start), ("end", end)):
        if value is not None and not 0.0 <= value <= MAX_TIMESTAMP:  # NaN fails both comparisons
            raise errors.InvalidArgument(
                f"{name} must be a Unix time in seconds between 0 and {MAX_TIMESTAMP:.0f}", field=name
            )
    if start is not None and end is not None and start > end:
        raise errors.InvalidArgument("start must not be after end", field="start")
