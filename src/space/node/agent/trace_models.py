"""The shapes of recorded traces over HTTP (ADR 0072): the node's answer to the control plane and the
control plane's answer to `GET /v1/sandboxes/{id}/traces`; the records are space.core.tracing's.

Invariants:
- A span's attributes are the allowed scalar ones only (space.core.tracing.ALLOWED_ATTRIBUTES), validated
  again here, so an answer never carries anything else whatever its source put in.
- A request names at most MAX_TRACE_IDS trace ids, each 32 lowercase hex digits.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, field_validator

from space.core import tracing

MAX_TRACE_IDS = 100
MAX_LIMIT = 100
TraceId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


class SpanView(BaseModel):
    trace_id: TraceId
    span_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
    parent_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")] | None
    name: Annotated[str, StringConstraints(max_length=tracing.MAX_NAME)]
    #: Which part of SPACE recorded it: space.controlplane, space.node, space.node.helper, space.guest.
    layer: Annotated[str, StringConstraints(max_length=32)]
    start_ns: int = Field(ge=0)
    end_ns: int = Field(ge=0)
    error: bool = False
    attributes: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("attributes")
    @classmethod
    def _allowed_only(cls, value: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        return tracing.clean_attributes(value)


class TraceView(BaseModel):
    trace_id: TraceId
    spans: list[SpanView]


class NodeTracesAnswer(BaseModel):
    """The node's spans of the traces the control plane asked for (only traces about that sandbox)."""

    spans: list[SpanView]


class TracesAnswer(BaseModel):
    """A sandbox's recent operations, oldest first, each with the spans of every layer, by start time."""

    sandbox_id: str
    traces: list[TraceView]
