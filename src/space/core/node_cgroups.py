"""The name of the cgroup a node's sandboxes run under (`cgroup_parent`): one validator for every place that
takes one, so a name one accepts is never refused later by another (ADR 0079).

Invariants:
- A cgroup parent is `space` followed by at most MAX_SUFFIX characters of [a-z0-9-]: the root helper
  creates and removes it under /sys/fs/cgroup, so it can name nothing outside SPACE's own groups (no `/`,
  no `..`, no other service's group).
- `space node join`, `space service install` and the helper's `--cgroup-parent` all call
  `parse_cgroup_parent`; a refused name is an InvalidArgument naming the setting, before anything starts.
"""

from __future__ import annotations

import re
from typing import Final

from space.core import errors

PREFIX: Final = "space"
MAX_SUFFIX: Final = 40
_PATTERN: Final = re.compile(rf"{PREFIX}[a-z0-9-]{{0,{MAX_SUFFIX}}}")
SHOWN_CHARS: Final = 60


def parse_cgroup_parent(value: str) -> str:
    """`value` if it is a cgroup parent a node may use, else InvalidArgument (the value shown cut)."""
    if _PATTERN.fullmatch(value) is None:
        raise errors.InvalidArgument(
            f"cgroup_parent {value[:SHOWN_CHARS]!r}: '{PREFIX}' followed by at most {MAX_SUFFIX} characters "
            "of [a-z0-9-] (the cgroup under /sys/fs/cgroup the node's helper makes for its sandboxes)",
            field="cgroup_parent",
        )
    return value
