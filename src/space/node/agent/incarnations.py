"""Which incarnation of each sandbox this node holds: the control plane's generation at which the copy here
was placed (docs/adr/0032-lost-nodes-and-incarnations.md).

A sandbox id alone does not say WHICH copy a request means: a sandbox suspended from this node and restored
onto it again, or created here, re-planned while this node was away, and placed here once more, has had two
copies here under one id. Deletes and orphan collection name the incarnation they mean, so a stale one
(sent for the old copy, arriving after the new one was placed) is refused instead of removing the new copy.

Invariants:
- `place` records the incarnation of a copy BEFORE the placing step starts (create, restore, fork): from
  then on a request naming another incarnation is refused (Conflict, 409, reason `stale_incarnation`), even
  while the copy is still being made. A copy that holds another recorded incarnation is never re-labelled:
  placing over it is refused too (the control plane deletes the stale copy, naming its incarnation, first).
- A copy with no recorded incarnation (made before incarnations existed, or by a caller that names none)
  matches any named incarnation: the old rules apply to it. A request that names none matches any copy.
- The map is persisted (a small JSON file in the agent's private state directory, written atomically) on
  every change and loaded at start, so a restarted agent refuses the same stale requests; `keep_only` drops
  entries of sandboxes the node no longer holds when the agent adopts what runs.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterable
from typing import Final

from space.core import errors
from space.core.ids import parse_sandbox_id
from space.node.filemodes import replace_private_file

log = logging.getLogger(__name__)

MAX_INCARNATION: Final = 2**63 - 1  # a generation is a BIGINT
FILE_VERSION: Final = 1


def parse_incarnation(value: object, *, field: str = "incarnation") -> int:
    """A non-negative BIGINT incarnation; InvalidArgument for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INCARNATION:
        raise errors.InvalidArgument(
            f"{field} must be an integer between 0 and {MAX_INCARNATION}", field=field
        )
    return value


def stale(sandbox_id: str, held: int, named: int, what: str) -> errors.Conflict:
    return errors.Conflict(
        f"{what}: this node holds incarnation {held} of sandbox {sandbox_id}, not {named}",
        reason="stale_incarnation", sandbox_id=sandbox_id, incarnation=held, named=named,
    )  # fmt: skip


class Incarnations:
    """sandbox id -> incarnation of this node's copy (or of the copy being placed here)."""

    def __init__(self, path: pathlib.Path | None = None) -> None:
        #: Where the map is persisted (None: memory only, for tests of the logic above it).
        self.path = path
        self._held: dict[str, int] = self._load()

    def get(self, sandbox_id: str) -> int | None:
        return self._held.get(parse_sandbox_id(sandbox_id))

    def place(self, sandbox_id: str, incarnation: int, *, has_copy: bool) -> None:
        """Record that the copy placed here now is `incarnation`. Conflict if a copy of another recorded
        incarnation is here (it is stale: it must be deleted, naming its own incarnation, first)."""
        sandbox_id, incarnation = parse_sandbox_id(sandbox_id), parse_incarnation(incarnation)
        held = self._held.get(sandbox_id)
        if held == incarnation:
            return
        if held is not None and has_copy:
            raise stale(sandbox_id, held, incarnation, "placing a new copy")
        self._held[sandbox_id] = incarnation
        self._save()

    def check(self, sandbox_id: str, named: int | None, what: str) -> None:
        """Conflict unless a request naming `named` (None: any) may act on this node's copy."""
        held = self._held.get(parse_sandbox_id(sandbox_id))
        if named is not None and held is not None and held != parse_incarnation(named):
            raise stale(sandbox_id, held, named, what)

    def forget(self, sandbox_id: str, named: int | None = None) -> None:
        """The copy is gone: drop its entry (only if it is still `named`, when named)."""
        held = self._held.get(sandbox_id)
        if held is None or (named is not None and held != named):
            return
        del self._held[sandbox_id]
        self._save()

    def keep_only(self, sandbox_ids: Iterable[str]) -> None:
        keep = set(sandbox_ids)
        dropped = [sandbox_id for sandbox_id in self._held if sandbox_id not in keep]
        for sandbox_id in dropped:
            del self._held[sandbox_id]
        if dropped:
            self._save()

    # -- persistence ---------------------------------------------------------------------------------------
    def _load(self) -> dict[str, int]:
        if self.path is None:
            return {}
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            entries = raw["incarnations"]
            return {parse_sandbox_id(k): parse_incarnation(v) for k, v in dict(entries).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, errors.SpaceError) as exc:
            # Unreadable: start empty. Every copy then matches any named incarnation (the old rules), which
            # is what an agent without this file did; never a reason not to start.
            log.warning("incarnations file %s unreadable (%s): starting without recorded incarnations",
                        self.path, exc)  # fmt: skip
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        body = json.dumps({"version": FILE_VERSION, "incarnations": self._held}, sort_keys=True).encode()
        replace_private_file(self.path, body, durable=True)
