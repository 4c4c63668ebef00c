"""The argument types of the root helper's verbs (verbs.py, transfer.py): one definition of what an id,
a template name or an environment entry may be.

Invariants:
- Ids and names match their space.core.ids pattern as a whole (pydantic's `pattern` alone would accept
  a match anywhere in the string).
- Every verb's parameter model forbids extra fields, is strict (no coercion) and frozen.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

from space.core.ids import SANDBOX_ID_PATTERN, SNAPSHOT_ID_PATTERN, TEMPLATE_NAME_PATTERN


def _anchored(pattern: str) -> str:
    return f"^(?:{pattern})$"


SandboxId = Annotated[str, StringConstraints(pattern=_anchored(SANDBOX_ID_PATTERN))]
SnapshotId = Annotated[str, StringConstraints(pattern=_anchored(SNAPSHOT_ID_PATTERN))]
TemplateName = Annotated[str, StringConstraints(pattern=_anchored(TEMPLATE_NAME_PATTERN))]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
EnvValue = Annotated[str, StringConstraints(max_length=32768, pattern=r"^[^\x00]*$")]


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
