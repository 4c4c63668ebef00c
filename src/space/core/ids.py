"""Typed identifiers of SPACE: generation and strict validation (pure: no I/O).

Every resource id is `<prefix><body>` where the body is the RFC 4648 base32 encoding of 16 random bytes,
lowercased, without padding: exactly 26 characters. 128 bits take 25 full base32 characters plus 3 bits,
so the last character only ever carries values whose two low bits are zero (`a e i m q u y 4`); the
patterns below accept exactly the canonical encodings, so one id has one spelling.

Invariants:
- `new_<kind>_id()` always returns a string that `parse_<kind>_id()` accepts (tested by roundtrip).
- A validator accepts a string only if the *whole* string matches its pattern (`re.fullmatch`, never
  `re.match` or `$`, which would let a trailing newline through). Anything else raises
  `space.core.errors.InvalidArgument` naming the field, so ids are safe to embed in paths, argv and
  log lines: they never contain `/`, `.`, whitespace, NUL or upper case.
- The `*_PATTERN` strings are unanchored and carry no flags, so the node helper (or any other component)
  can apply them with `re.fullmatch` verbatim; `re.ASCII`-independent because every class is explicit.
- Process ids are chosen by the in-sandbox daemon (`os.urandom(8).hex()` in space.guest.processes) and only
  mean something inside it; they are validated here all the same (`parse_process_id`), so a process id in a
  public path can never carry a `/`, a dot or an encoding to the node.
"""

from __future__ import annotations

import base64
import re
import secrets
from dataclasses import dataclass
from typing import Final, NewType

from space.core.errors import InvalidArgument

# The body: 25 characters of the lowercased RFC 4648 alphabet, then one that carries the last 3 bits.
ID_BODY_PATTERN: Final = "[a-z2-7]{25}[aeimquy4]"
ID_BODY_LENGTH: Final = 26
_RANDOM_BYTES: Final = 16

SANDBOX_ID_PREFIX: Final = "sb-"
SNAPSHOT_ID_PREFIX: Final = "snap-"
NODE_ID_PREFIX: Final = "node-"
PROJECT_ID_PREFIX: Final = "prj-"
ORG_ID_PREFIX: Final = "org-"
API_KEY_ID_PREFIX: Final = "key-"

SANDBOX_ID_PATTERN: Final = SANDBOX_ID_PREFIX + ID_BODY_PATTERN
SNAPSHOT_ID_PATTERN: Final = SNAPSHOT_ID_PREFIX + ID_BODY_PATTERN
NODE_ID_PATTERN: Final = NODE_ID_PREFIX + ID_BODY_PATTERN
PROJECT_ID_PATTERN: Final = PROJECT_ID_PREFIX + ID_BODY_PATTERN
ORG_ID_PATTERN: Final = ORG_ID_PREFIX + ID_BODY_PATTERN
API_KEY_ID_PATTERN: Final = API_KEY_ID_PREFIX + ID_BODY_PATTERN

# Template names are chosen by people (`--template python`), so they are readable, not random; they
# also name btrfs subvolumes, hence no dots, slashes or upper case.
TEMPLATE_NAME_PATTERN: Final = "[a-z][a-z0-9-]{0,62}"
TEMPLATE_NAME_MAX_LENGTH: Final = 63

# A user template (docs/adr/0055-templates-in-the-control-plane.md): its control-plane id is `tpl_<16 hex>`
# and its node-level name, a TEMPLATE_NAME_PATTERN name, is `tpl-<the same 16 hex>` (the underscore would not
# fit a subvolume name; the dash keeps the two spellings apart, so an id is never mistaken for a name).
TEMPLATE_ID_PREFIX: Final = "tpl_"
TEMPLATE_NODE_PREFIX: Final = "tpl-"
TEMPLATE_ID_PATTERN: Final = TEMPLATE_ID_PREFIX + "[0-9a-f]{16}"
TEMPLATE_ID_LENGTH: Final = len(TEMPLATE_ID_PREFIX) + 16

#: What the guest daemon makes: 8 random bytes as lowercase hex.
PROCESS_ID_PATTERN: Final = "[0-9a-f]{16}"
PROCESS_ID_LENGTH: Final = 16

SandboxId = NewType("SandboxId", str)
SnapshotId = NewType("SnapshotId", str)
NodeId = NewType("NodeId", str)
ProjectId = NewType("ProjectId", str)
OrgId = NewType("OrgId", str)
ApiKeyId = NewType("ApiKeyId", str)
TemplateName = NewType("TemplateName", str)
TemplateId = NewType("TemplateId", str)
ProcessId = NewType("ProcessId", str)

# How much of a rejected value an error message may quote: enough to recognise it, never a whole
# megabyte pasted into a log line.
_QUOTE_LIMIT: Final = 40


@dataclass(frozen=True, slots=True)
class IdKind:
    """One kind of prefixed random id."""

    name: str  # the default field name in errors, e.g. "sandbox_id"
    prefix: str

    @property
    def pattern(self) -> str:
        return self.prefix + ID_BODY_PATTERN

    @property
    def length(self) -> int:
        return len(self.prefix) + ID_BODY_LENGTH


SANDBOX: Final = IdKind("sandbox_id", SANDBOX_ID_PREFIX)
SNAPSHOT: Final = IdKind("snapshot_id", SNAPSHOT_ID_PREFIX)
NODE: Final = IdKind("node_id", NODE_ID_PREFIX)
PROJECT: Final = IdKind("project_id", PROJECT_ID_PREFIX)
ORG: Final = IdKind("org_id", ORG_ID_PREFIX)
API_KEY: Final = IdKind("api_key_id", API_KEY_ID_PREFIX)
ID_KINDS: Final[tuple[IdKind, ...]] = (SANDBOX, SNAPSHOT, NODE, PROJECT, ORG, API_KEY)

_COMPILED: Final[dict[str, re.Pattern[str]]] = {k.prefix: re.compile(k.pattern) for k in ID_KINDS}
_TEMPLATE_RE: Final = re.compile(TEMPLATE_NAME_PATTERN)
_PROCESS_RE: Final = re.compile(PROCESS_ID_PATTERN)
_TEMPLATE_ID_RE: Final = re.compile(TEMPLATE_ID_PATTERN)


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE_LIMIT else text[: _QUOTE_LIMIT - 3] + "..."


def _random_body() -> str:
    return base64.b32encode(secrets.token_bytes(_RANDOM_BYTES)).decode("ascii").rstrip("=").lower()


def new_id(kind: IdKind) -> str:
    """A fresh random id of `kind` (128 bits from `secrets`, so collisions are not a practical concern)."""
    return kind.prefix + _random_body()


def parse_id(kind: IdKind, value: object, *, field: str | None = None) -> str:
    """Return `value` unchanged if it is a well-formed id of `kind`, else raise InvalidArgument."""
    name = field or kind.name
    # The length check first: it is cheap and keeps huge inputs away from the regex engine.
    if (
        not isinstance(value, str)
        or len(value) != kind.length
        or _COMPILED[kind.prefix].fullmatch(value) is None
    ):
        raise InvalidArgument(
            f"invalid {name}: expected {kind.prefix!r} followed by {ID_BODY_LENGTH} lowercase base32 "
            f"characters, got {_quote(value)}",
            field=name,
        )
    return value


def is_valid_id(kind: IdKind, value: object) -> bool:
    try:
        parse_id(kind, value)
    except InvalidArgument:
        return False
    return True


def id_body_bytes(kind: IdKind, value: str) -> bytes:
    """The 16 random bytes behind a valid id (inverse of generation; useful for compact storage)."""
    body = parse_id(kind, value)[len(kind.prefix) :]
    return base64.b32decode(body.upper() + "======")


def new_sandbox_id() -> SandboxId:
    return SandboxId(new_id(SANDBOX))


def new_snapshot_id() -> SnapshotId:
    return SnapshotId(new_id(SNAPSHOT))


def new_node_id() -> NodeId:
    return NodeId(new_id(NODE))


def new_project_id() -> ProjectId:
    return ProjectId(new_id(PROJECT))


def new_org_id() -> OrgId:
    return OrgId(new_id(ORG))


def new_api_key_id() -> ApiKeyId:
    return ApiKeyId(new_id(API_KEY))


def parse_sandbox_id(value: object, *, field: str = SANDBOX.name) -> SandboxId:
    return SandboxId(parse_id(SANDBOX, value, field=field))


def parse_snapshot_id(value: object, *, field: str = SNAPSHOT.name) -> SnapshotId:
    return SnapshotId(parse_id(SNAPSHOT, value, field=field))


def parse_node_id(value: object, *, field: str = NODE.name) -> NodeId:
    return NodeId(parse_id(NODE, value, field=field))


def parse_project_id(value: object, *, field: str = PROJECT.name) -> ProjectId:
    return ProjectId(parse_id(PROJECT, value, field=field))


def parse_org_id(value: object, *, field: str = ORG.name) -> OrgId:
    return OrgId(parse_id(ORG, value, field=field))


def parse_api_key_id(value: object, *, field: str = API_KEY.name) -> ApiKeyId:
    return ApiKeyId(parse_id(API_KEY, value, field=field))


def parse_template_name(value: object, *, field: str = "template") -> TemplateName:
    """Return `value` if it is a valid template name (`[a-z][a-z0-9-]{0,62}`, whole string)."""
    if (
        not isinstance(value, str)
        or len(value) > TEMPLATE_NAME_MAX_LENGTH
        or _TEMPLATE_RE.fullmatch(value) is None
    ):
        raise InvalidArgument(
            f"invalid {field}: expected a lowercase letter followed by up to 62 lowercase letters, digits "
            f"or '-', got {_quote(value)}",
            field=field,
        )
    return TemplateName(value)


def new_template_id() -> TemplateId:
    """A fresh user template id: `tpl_` and 8 random bytes as lowercase hex (64 bits: ids are unique in one
    table, where the insert would refuse a collision)."""
    return TemplateId(TEMPLATE_ID_PREFIX + secrets.token_hex(8))


def parse_template_id(value: object, *, field: str = "template_id") -> TemplateId:
    """Return `value` if it is a user template id (`tpl_` and 16 lowercase hex digits, whole string)."""
    if (
        not isinstance(value, str)
        or len(value) != TEMPLATE_ID_LENGTH
        or _TEMPLATE_ID_RE.fullmatch(value) is None
    ):
        raise InvalidArgument(
            f"invalid {field}: expected {TEMPLATE_ID_PREFIX!r} followed by 16 lowercase hex digits, "
            f"got {_quote(value)}",
            field=field,
        )
    return TemplateId(value)


def template_node_name(template_id: str) -> TemplateName:
    """The node-level name of a user template (`tpl_<hex>` -> `tpl-<hex>`): what sandboxes, node RPCs, helper
    verbs and subvolumes use."""
    return TemplateName(TEMPLATE_NODE_PREFIX + parse_template_id(template_id)[len(TEMPLATE_ID_PREFIX) :])


def parse_process_id(value: object, *, field: str = "process_id") -> ProcessId:
    """Return `value` if it is a process id as the guest daemon makes them (16 lowercase hex digits)."""
    if not isinstance(value, str) or len(value) != PROCESS_ID_LENGTH or _PROCESS_RE.fullmatch(value) is None:
        raise InvalidArgument(
            f"invalid {field}: expected {PROCESS_ID_LENGTH} lowercase hex digits, got {_quote(value)}",
            field=field,
        )
    return ProcessId(value)
