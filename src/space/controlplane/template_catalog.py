"""Which template a project means: names and ids to records, built-ins synthesised (ADR 0055).

Users name a template by its name (unique in their project), by its id `tpl_<hex>`, or by a built-in's name
(`python`, `base`, ...: space.node.volumes.templates.BUILTIN_TEMPLATES, visible to every project); the
control plane turns that into the node-level name (`tpl-<hex>` or the built-in's own) that sandbox rows,
node RPCs and subvolumes use.

Invariants:
- A project sees only its own templates: another project's template, by id, by name or by node-level
  name, resolves exactly as one that does not exist (NotFound, the API's 404), never PermissionDenied.
- A node-level name `tpl-<hex>` is accepted only for the caller's own template: sandboxes of another
  project's template cannot be made by naming its subvolume.
- A project template's name may not shadow a built-in and may not begin with `tpl-` (reserved for
  node-level names), so every name resolves one way.
- `require_ready` is the one check a create makes: a template that is building, failed or deleting is
  InvalidState (409) naming its status.
"""

from __future__ import annotations

from typing import Final

from space.controlplane.store.records import TemplateRecord
from space.controlplane.store.store import Store
from space.core import errors, ids
from space.core.template_states import require_usable
from space.node.volumes.templates import BUILTIN_TEMPLATES

_RESERVED_PREFIX: Final = ids.TEMPLATE_NODE_PREFIX
MAX_REF_LENGTH: Final = 64  # what a template reference may be (a name or an id): both fit


def builtin_names() -> tuple[str, ...]:
    return tuple(sorted(BUILTIN_TEMPLATES))


def builtin_record(name: str) -> TemplateRecord:
    """The synthesised record of a built-in template (no row: its id is its name, every project sees it)."""
    spec = BUILTIN_TEMPLATES[name]
    return TemplateRecord(
        id=name, project_id=None, name=name, node_name=name, status="ready", spec={}, source="builtin",
        node_id=None, size_bytes=None, default_user=spec.default_user, workdir=spec.workdir, error=None,
        lease_owner=None, lease_until=None, log_bytes=0, log_truncated=False, created_at=None,
        updated_at=None,
    )  # fmt: skip


def check_new_name(name: object) -> str:
    """A name a project may give a new template: a template name, not a built-in's, not `tpl-...`."""
    valid = ids.parse_template_name(name, field="name")
    if valid in BUILTIN_TEMPLATES:
        raise errors.AlreadyExists(f"{valid!r} is a built-in template's name", field="name")
    if valid.startswith(_RESERVED_PREFIX):
        raise errors.InvalidArgument(
            f"template names beginning with {_RESERVED_PREFIX!r} are reserved for node-level names",
            field="name",
        )
    return valid


def not_found(ref: str) -> errors.NotFound:
    return errors.NotFound(f"template {ref[:80]!r} not found", field="template")


def find(store: Store, project_id: str, ref: object) -> TemplateRecord:
    """The template `ref` names for the project (an id, a name, its node-level name or a built-in's name);
    NotFound when the project has none such, InvalidArgument when `ref` could be neither."""
    if not isinstance(ref, str) or not ref or len(ref) > MAX_REF_LENGTH:
        raise errors.InvalidArgument("invalid template: expected a template name or id", field="template")
    if ref.startswith(ids.TEMPLATE_ID_PREFIX):
        record = store.get_template(project_id, ids.parse_template_id(ref, field="template"))
    elif ref.startswith(_RESERVED_PREFIX):
        record = store.template_by_node_name(ids.parse_template_name(ref))
        record = record if record is not None and record.project_id == project_id else None
    else:
        name = ids.parse_template_name(ref)
        if name in BUILTIN_TEMPLATES:
            return builtin_record(name)
        record = store.find_template(project_id, name)
    if record is None:
        raise not_found(ref)
    return record


def require_ready(record: TemplateRecord) -> str:
    """The node-level name of a template a sandbox may be made from now (InvalidState naming its status)."""
    require_usable(record.status, record.name)
    return record.node_name


def resolve_for_create(store: Store, project_id: str, ref: object) -> str:
    """What a create's `template` means for the project: the node-level name of a ready template."""
    return require_ready(find(store, project_id, ref))
