"""The node's record of every sandbox's egress policy (create request or the last push), kept in the
gateway's state directory so it survives agent restarts.

Invariants:
- The file is replaced atomically (written beside it, then renamed): a crash leaves the old or the new
  record, never half of one.
- An unreadable file, or an entry that no longer validates, is skipped (that sandbox then has no record;
  with a control plane its policy is asked for, without one it has no egress: fail closed).
- Only credential names are recorded, never values.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from dataclasses import dataclass, field

from pydantic import ValidationError

from space.node.agent.egress_settings import EgressRequest

POLICIES_FILE = "policies.json"


@dataclass
class PolicyRecord:
    policy: EgressRequest
    credentials: list[str] = field(default_factory=list)


def load_records(state_dir: pathlib.Path) -> dict[str, PolicyRecord]:
    try:
        raw = json.loads((state_dir / POLICIES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    records: dict[str, PolicyRecord] = {}
    for sandbox_id, item in raw.items() if isinstance(raw, dict) else []:
        with contextlib.suppress(ValidationError, KeyError, TypeError):
            records[sandbox_id] = PolicyRecord(EgressRequest.model_validate(item["policy"]),
                                               [str(n) for n in item.get("credentials", [])])  # fmt: skip
    return records


def save_records(state_dir: pathlib.Path, records: dict[str, PolicyRecord]) -> None:
    data = {
        sid: {"policy": r.policy.model_dump(), "credentials": r.credentials} for sid, r in records.items()
    }
    path = state_dir / POLICIES_FILE
    tmp = path.with_name(f".{POLICIES_FILE}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
