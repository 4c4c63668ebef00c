"""Rows to records: the one place where ORM objects become the frozen records callers get.

Invariants:
- Every record the store hands out is built by a `RowMapper` from a row read or written inside a
  transaction, so no ORM object leaves the store package (models.py).
- The mapping is generic, not written field by field: each field the record type declares is read from
  the row's attribute of the same name (what pydantic's `from_attributes` does for models; records stay
  plain frozen dataclasses, which pydantic cannot read from attributes directly), and pydantic validates
  and converts the values by the record's annotations (states to `State`, limits to `SandboxLimits`,
  literals checked, containers copied). A field that is not a column is derived by a named function.
- A row that does not parse (an unknown state, malformed limits, a role outside its literal) fails
  loudly on read instead of reaching the API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter

from space.controlplane.store.records import (
    RELEASE_KEY,
    ApiKeyRecord,
    IdempotencyRecordView,
    NodeRecord,
    OrgRecord,
    ProjectRecord,
    SandboxRecord,
    SnapshotRecord,
    TemplateLogLine,
    TemplateRecord,
)

R = TypeVar("R")


class RowMapper(Generic[R]):
    """Builds records of the dataclass `kind` from ORM rows (see the module invariants); `derived` maps a
    field that is not a column to the function that computes it from the row."""

    def __init__(self, kind: type[R], **derived: Callable[[Any], Any]) -> None:
        names = {field.name for field in dataclasses.fields(kind)}  # type: ignore[arg-type]
        unknown = set(derived) - names
        if unknown:
            raise TypeError(f"{kind.__name__} has no fields {sorted(unknown)}")
        self._columns = tuple(sorted(names - set(derived)))
        self._derived = derived
        self._adapter = TypeAdapter(kind)

    def __call__(self, row: object) -> R:
        values = {name: getattr(row, name) for name in self._columns}
        values.update((name, compute(row)) for name, compute in self._derived.items())
        return self._adapter.validate_python(values)


org_record = RowMapper(OrgRecord)
project_record = RowMapper(ProjectRecord)
api_key_record = RowMapper(ApiKeyRecord)


def _node_runtime(row: Any) -> dict[str, Any] | None:
    runtime = row.runtime
    return None if runtime is None else {key: value for key, value in runtime.items() if key != RELEASE_KEY}


def _node_release(row: Any) -> str | None:
    release = (row.runtime or {}).get(RELEASE_KEY)
    return release if isinstance(release, str) else None


node_record = RowMapper(NodeRecord, runtime=_node_runtime, space_version=_node_release)
# `metadata_`: declarative classes reserve the attribute name `metadata` (models.Sandbox).
sandbox_record = RowMapper(SandboxRecord, metadata=lambda row: row.metadata_ or {})
snapshot_record = RowMapper(SnapshotRecord)
idempotency_record = RowMapper(IdempotencyRecordView)
template_record = RowMapper(TemplateRecord)
template_log_line = RowMapper(TemplateLogLine)
