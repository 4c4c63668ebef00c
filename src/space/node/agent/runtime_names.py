"""Runtime names: which runtime on this node serves each sandbox id, and which runtimes are pooled
(docs/adr/0047-warm-pools.md).

A pooled sandbox is started before anyone asks for it, so it cannot carry the id its user will see: it runs
under a runtime id of its own (a sandbox id nobody else is ever given). When a create binds it, the user's
sandbox id becomes an alias of that runtime. The root helper only ever sees runtime ids; everything above
the helper client (the agent's registry, incarnations, egress policies, the control plane) only ever sees
sandbox ids. `HelperClient.call` translates in both directions, in one place.

Invariants:
- An alias is active in memory from `claim` on (so the bind's own helper calls reach the runtime), and
  durable only from `commit`: a bind interrupted by a crash leaves a pool member in the file, which the next
  start destroys; the control plane's repeated create then makes a fresh sandbox. Never half a sandbox.
- A pooled runtime is recorded in the file (`add_member`) BEFORE the helper is asked to start it, so a fill
  interrupted by a crash is found and destroyed at the next start: pools are never leaked.
- A runtime serves at most one sandbox id, and a member is never bound twice: `claim` refuses a runtime that
  is not a member or is already claimed.
- Ids without an alias translate to themselves: every sandbox made outside a pool (restores, forks, warm and
  cold creates) keeps runtime id == sandbox id.
- The file is written atomically (temporary file + rename); `commit` and `forget` also fsync it, since an
  alias must survive a machine restart with the sandbox's files; member records need not (a machine
  restart ends the pooled runtimes with it).
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any, Final

from space.core import errors
from space.core.ids import parse_sandbox_id, parse_template_name
from space.node.filemodes import replace_private_file

log = logging.getLogger(__name__)

FILE_VERSION: Final = 1
#: Result fields of helper verbs that name a sandbox (translated back to the sandbox id).
ID_FIELDS: Final = ("sandbox_id", "source_sandbox_id")


class RuntimeNames:
    """sandbox id -> runtime id (aliases of bound pooled runtimes), and the pooled runtimes by template."""

    def __init__(self, path: pathlib.Path | None = None) -> None:
        #: Where the names are persisted (None: memory only, for tests of the logic above it).
        self.path = path
        self._aliases, self._members = self._load()
        self._claimed: dict[str, str] = {}  # sandbox id -> runtime id, claimed but not yet committed
        self._reverse = {runtime: public for public, runtime in self._aliases.items()}

    # -- translation ---------------------------------------------------------------------------------------
    def to_runtime(self, sandbox_id: str) -> str:
        return self._claimed.get(sandbox_id) or self._aliases.get(sandbox_id) or sandbox_id

    def to_sandbox(self, runtime_id: str) -> str:
        found = self._reverse.get(runtime_id)
        if found is None and self._claimed:
            found = next((s for s, r in self._claimed.items() if r == runtime_id), None)
        return found or runtime_id

    def _active(self) -> bool:
        return bool(self._reverse or self._claimed)

    def args_to_runtime(self, args: dict[str, Any]) -> dict[str, Any]:
        if not self._active() or not any(isinstance(args.get(f), str) for f in ID_FIELDS):
            return args
        return {
            k: self.to_runtime(v) if k in ID_FIELDS and isinstance(v, str) else v for k, v in args.items()
        }

    def result_to_sandbox(self, value: Any) -> Any:
        """`value` with every sandbox-naming field of every nested mapping translated back."""
        if not self._active():
            return value
        if isinstance(value, dict):
            return {
                k: self.to_sandbox(v) if k in ID_FIELDS and isinstance(v, str) else self.result_to_sandbox(v)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.result_to_sandbox(v) for v in value]
        return value

    # -- pool members --------------------------------------------------------------------------------------
    def members(self) -> dict[str, str]:
        """Pooled runtime id -> template, of the members neither claimed nor bound."""
        claimed = set(self._claimed.values())
        return {runtime: t for runtime, t in self._members.items() if runtime not in claimed}

    def is_member(self, runtime_id: str) -> bool:
        return runtime_id in self._members

    def add_member(self, runtime_id: str, template: str) -> None:
        runtime_id, template = parse_sandbox_id(runtime_id), parse_template_name(template)
        if runtime_id in self._members or runtime_id in self._reverse:
            raise errors.AlreadyExists(f"runtime {runtime_id} is already named")
        self._members[runtime_id] = template
        self._save(durable=False)

    def drop_member(self, runtime_id: str) -> None:
        if self._members.pop(runtime_id, None) is not None:
            self._save(durable=False)

    # -- binding -------------------------------------------------------------------------------------------
    def claim(self, sandbox_id: str, runtime_id: str) -> None:
        """Start binding member `runtime_id` to `sandbox_id` (active now, durable at `commit`)."""
        sandbox_id = parse_sandbox_id(sandbox_id)
        if runtime_id not in self._members or runtime_id in self._claimed.values():
            raise errors.Conflict(f"runtime {runtime_id} is not a free pool member", reason="not_pooled")
        if sandbox_id in self._aliases or sandbox_id in self._claimed or sandbox_id in self._members:
            raise errors.AlreadyExists(f"sandbox {sandbox_id} is already named on this node")
        self._claimed[sandbox_id] = runtime_id

    def commit(self, sandbox_id: str) -> None:
        """Make the claim durable; if that fails nothing changed (the claim stays, for `release`)."""
        runtime_id = self._claimed[sandbox_id]
        template = self._members.pop(runtime_id)
        self._aliases[sandbox_id] = runtime_id
        self._reverse[runtime_id] = sandbox_id
        try:
            self._save(durable=True)
        except BaseException:
            del self._aliases[sandbox_id], self._reverse[runtime_id]
            self._members[runtime_id] = template
            raise
        del self._claimed[sandbox_id]

    def release(self, sandbox_id: str) -> str | None:
        """Abandon a claim (the bind failed); its runtime, still a member, for the caller to destroy."""
        return self._claimed.pop(sandbox_id, None)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone from this node: drop its alias (its runtime is gone with it)."""
        runtime_id = self._aliases.pop(sandbox_id, None)
        if runtime_id is not None:
            self._reverse.pop(runtime_id, None)
            self._save(durable=True)

    def keep_only(self, sandbox_ids: set[str]) -> None:
        """After adoption: aliases of sandboxes the node no longer holds are dropped."""
        gone = [s for s in self._aliases if s not in sandbox_ids]
        for sandbox_id in gone:
            self._reverse.pop(self._aliases.pop(sandbox_id), None)
        if gone:
            self._save(durable=True)

    # -- persistence ---------------------------------------------------------------------------------------
    def _load(self) -> tuple[dict[str, str], dict[str, str]]:
        if self.path is None:
            return {}, {}
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            aliases: dict[str, str] = {
                parse_sandbox_id(k): parse_sandbox_id(v) for k, v in dict(raw["aliases"]).items()
            }
            members: dict[str, str] = {
                parse_sandbox_id(k): parse_template_name(v) for k, v in dict(raw["members"]).items()
            }
            if len(set(aliases.values())) != len(aliases) or set(aliases.values()) & set(members):
                raise ValueError("a runtime is named twice")
            return aliases, members
        except FileNotFoundError:
            return {}, {}
        except (OSError, ValueError, KeyError, TypeError, errors.SpaceError) as exc:
            # Unreadable: without aliases, bound pooled sandboxes are not recognised and the control plane
            # collects them as orphans; pooled runtimes are adopted as unknown sandboxes and collected too.
            # Loud, but never a reason not to start.
            log.error("runtime names file %s unreadable (%s): starting without aliases", self.path, exc)
            return {}, {}

    def _save(self, *, durable: bool) -> None:
        if self.path is None:
            return
        body = json.dumps(
            {"version": FILE_VERSION, "aliases": self._aliases, "members": self._members}, sort_keys=True
        ).encode()
        replace_private_file(self.path, body, durable=durable)
