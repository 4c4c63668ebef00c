"""The template build spec: what a user template is built from and which steps make it (pure: no I/O).

The same JSON travels in the control-plane API and in the node RPC (`POST /v1/templates/{name}/build`):

    {"from": "python" | "base" | "tpl-<16 hex>" | "oci:<staged archive ref>",
     "steps": [{"apt": ["jq"]}, {"pip": ["six==1.16.0"]},
               {"file": {"path": "/etc/x", "content_b64": "...", "mode": 420}},
               {"run": "shell command"}, {"env": {"K": "V"}}, {"workdir": "/abs"}],
     "user": "name" | null, "start_cmd": "command" | null}

Invariants (docs/adr/0054-template-build.md):
- Every field is bounded: at most MAX_STEPS steps, MAX_PACKAGES packages per step, strings and paths of
  bounded length, no NUL anywhere, file contents at most MAX_FILE_BYTES each and MAX_FILES_BYTES in all
  (TooLarge), the whole spec at most MAX_SPEC_BYTES as canonical JSON (TooLarge). Anything else is
  InvalidArgument naming the field (`parse_build_spec` is the only entry point that turns data into a spec).
- A package name can never be read as an option or a URL: apt names fullmatch APT_PACKAGE_PATTERN and pip
  requirements PIP_REQUIREMENT_PATTERN (a name, optional extras and version clauses; no `@`, no spaces, no
  leading `-`), so a step's argv is always `install <names>` and nothing else.
- Paths (file, workdir) are absolute, normalised (no `.`/`..` component, no `//`), at most MAX_PATH bytes.
- `spec_hash` is the SHA-256 of the canonical JSON (sorted keys, no spaces), so equal specs hash equally
  whatever the key order they were sent in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from space.core.errors import InvalidArgument, TooLarge
from space.core.ids import TEMPLATE_NAME_MAX_LENGTH, TEMPLATE_NAME_PATTERN

MAX_STEPS: Final = 256
MAX_PACKAGES: Final = 128
MAX_FILE_BYTES: Final = 1024 * 1024
MAX_FILES_BYTES: Final = 8 * 1024 * 1024
MAX_SPEC_BYTES: Final = 12 * 1024 * 1024
MAX_RUN: Final = 16 * 1024
MAX_START_CMD: Final = 4096
MAX_PATH: Final = 1024
MAX_ENV_KEYS: Final = 64
MAX_ENV_VALUE: Final = 4096
MAX_FILE_MODE: Final = 0o7777

APT_PACKAGE_PATTERN: Final = r"[a-z0-9][a-z0-9+.-]{0,127}(=[A-Za-z0-9.+~:-]{1,64})?"
PIP_REQUIREMENT_PATTERN: Final = (
    r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
    r"(\[[A-Za-z0-9._-]{1,64}(,[A-Za-z0-9._-]{1,64}){0,15}\])?"
    r"((==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!-]{1,64}(,(==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!-]{1,64}){0,7})?"
)
ENV_KEY_PATTERN: Final = r"[A-Za-z_][A-Za-z0-9_]{0,127}"
USER_NAME_PATTERN: Final = r"[a-z_][a-z0-9_-]{0,31}"
OCI_REF_PATTERN: Final = r"oci:[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
#: A `from` is a node-level template name or a staged OCI archive.
FROM_PATTERN: Final = f"({TEMPLATE_NAME_PATTERN})|({OCI_REF_PATTERN})"

_APT = re.compile(APT_PACKAGE_PATTERN)
_PIP = re.compile(PIP_REQUIREMENT_PATTERN)
_ENV_KEY = re.compile(ENV_KEY_PATTERN)
_USER = re.compile(USER_NAME_PATTERN)
_FROM = re.compile(FROM_PATTERN)


def _no_nul(value: str, what: str) -> str:
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL")
    return value


def check_abs_path(value: str, what: str = "path") -> str:
    """`value` if it is an absolute, normalised path of at most MAX_PATH bytes; else ValueError."""
    _no_nul(value, what)
    if not value.startswith("/") or len(value.encode()) > MAX_PATH:
        raise ValueError(f"{what} must be an absolute path of at most {MAX_PATH} bytes")
    parts = value.split("/")[1:]
    if value != "/" and any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{what} must be normalised (no empty, '.' or '..' component)")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class AptStep(_Strict):
    apt: list[str] = Field(min_length=1, max_length=MAX_PACKAGES)

    @field_validator("apt")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            if _APT.fullmatch(name) is None:
                raise ValueError(f"invalid apt package {name[:64]!r}: expected {APT_PACKAGE_PATTERN}")
        return value


class PipStep(_Strict):
    pip: list[str] = Field(min_length=1, max_length=MAX_PACKAGES)

    @field_validator("pip")
    @classmethod
    def _requirements(cls, value: list[str]) -> list[str]:
        for req in value:
            if _PIP.fullmatch(req) is None:
                raise ValueError(f"invalid pip requirement {req[:64]!r}: a name, extras and version clauses")
        return value


class FileSpec(_Strict):
    path: str
    content_b64: str = Field(max_length=4 * ((MAX_FILE_BYTES + 2) // 3))
    mode: int = Field(default=0o644, ge=0, le=MAX_FILE_MODE)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        check_abs_path(value, "file path")
        if value == "/":
            raise ValueError("file path must name a file, not /")
        return value

    @field_validator("content_b64")
    @classmethod
    def _content(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("content_b64 is not valid base64") from exc
        return value

    def content(self) -> bytes:
        return base64.b64decode(self.content_b64, validate=True)


class FileStep(_Strict):
    file: FileSpec


class RunStep(_Strict):
    run: str = Field(min_length=1, max_length=MAX_RUN)

    @field_validator("run")
    @classmethod
    def _run(cls, value: str) -> str:
        return _no_nul(value, "run")


class EnvStep(_Strict):
    env: dict[str, str] = Field(min_length=1, max_length=MAX_ENV_KEYS)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if _ENV_KEY.fullmatch(key) is None:
                raise ValueError(f"invalid env key {key[:64]!r}: expected {ENV_KEY_PATTERN}")
            if key.startswith("SPACED_"):  # the daemon's own settings (ADR 0057), never a template's
                raise ValueError(f"env key {key[:64]!r}: SPACED_ variables are reserved")
            if len(val) > MAX_ENV_VALUE:
                raise ValueError(f"env value of {key} is longer than {MAX_ENV_VALUE} characters")
            _no_nul(val, f"env value of {key}")
        return value


class WorkdirStep(_Strict):
    workdir: str

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        return check_abs_path(value, "workdir")


BuildStep = AptStep | PipStep | FileStep | RunStep | EnvStep | WorkdirStep
StepKind = Literal["apt", "pip", "file", "run", "env", "workdir"]


class TemplateBuildSpec(_Strict):
    """A template build: a base (`from`), ordered steps, the default user and an optional start command."""

    from_: Annotated[str, Field(alias="from", max_length=4 + TEMPLATE_NAME_MAX_LENGTH + 64)]
    steps: list[BuildStep] = Field(default_factory=list, max_length=MAX_STEPS)
    user: str | None = None
    start_cmd: str | None = Field(default=None, min_length=1, max_length=MAX_START_CMD)

    @field_validator("from_")
    @classmethod
    def _from(cls, value: str) -> str:
        if _FROM.fullmatch(value) is None or (
            not value.startswith("oci:") and len(value) > TEMPLATE_NAME_MAX_LENGTH
        ):
            raise ValueError("from must be a template name or oci:<staged archive ref>")
        return value

    @field_validator("user")
    @classmethod
    def _user(cls, value: str | None) -> str | None:
        if value is not None and _USER.fullmatch(value) is None:
            raise ValueError(f"invalid user {value[:64]!r}: expected {USER_NAME_PATTERN}")
        return value

    @field_validator("start_cmd")
    @classmethod
    def _start_cmd(cls, value: str | None) -> str | None:
        return None if value is None else _no_nul(value, "start_cmd")

    @property
    def base_template(self) -> str | None:
        """The node-level template this builds on, or None when it starts from an OCI archive."""
        return None if self.from_.startswith("oci:") else self.from_

    @property
    def oci_ref(self) -> str | None:
        """The staged OCI archive ref (after `oci:`), or None when it builds on a template."""
        return self.from_.removeprefix("oci:") if self.from_.startswith("oci:") else None

    def wire(self) -> dict[str, Any]:
        """The JSON form (with `from`, not `from_`)."""
        return self.model_dump(mode="json", by_alias=True)

    def canonical_json(self) -> str:
        return json.dumps(self.wire(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def final_env(self) -> dict[str, str]:
        """Every env step merged in order (a later step overrides an earlier key)."""
        merged: dict[str, str] = {}
        for step in self.steps:
            if isinstance(step, EnvStep):
                merged.update(step.env)
        return merged

    def final_workdir(self) -> str | None:
        """The last workdir step's path, or None."""
        found: str | None = None
        for step in self.steps:
            if isinstance(step, WorkdirStep):
                found = step.workdir
        return found

    def needs_pip(self) -> bool:
        return any(isinstance(step, PipStep) for step in self.steps)


def step_kind(step: BuildStep) -> StepKind:
    """The step's one key (`apt`, `pip`, ...)."""
    kind = next(iter(type(step).model_fields))
    return kind  # type: ignore[return-value]


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors(include_url=False)[:8]:
        where = ".".join(str(part) for part in err["loc"]) or "(root)"
        problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)


def parse_build_spec(data: Any) -> TemplateBuildSpec:
    """A TemplateBuildSpec from request data; InvalidArgument naming the bad fields, TooLarge past a byte
    bound (a file's content, all files' contents, the whole spec)."""
    if isinstance(data, dict) and isinstance(data.get("steps"), list) and len(data["steps"]) > MAX_STEPS:
        # Refused before pydantic walks 10,000 steps and reports each.
        raise InvalidArgument(f"a build has at most {MAX_STEPS} steps", field="steps")
    try:
        spec = TemplateBuildSpec.model_validate(data)
    except ValidationError as exc:
        if any(err["type"] == "string_too_long" and "content_b64" in err["loc"] for err in exc.errors()):
            raise TooLarge(
                f"a file step holds at most {MAX_FILE_BYTES} bytes", field="steps", limit=MAX_FILE_BYTES
            ) from exc
        raise InvalidArgument(f"invalid build spec: {_describe(exc)}", field="spec") from exc
    total = sum(len(step.file.content()) for step in spec.steps if isinstance(step, FileStep))
    if total > MAX_FILES_BYTES:
        raise TooLarge(
            f"file steps hold {total} bytes; at most {MAX_FILES_BYTES} in all",
            field="steps",
            limit=MAX_FILES_BYTES,
        )
    for step in spec.steps:
        if isinstance(step, FileStep) and len(step.file.content()) > MAX_FILE_BYTES:
            raise TooLarge(f"a file step holds at most {MAX_FILE_BYTES} bytes", field="steps")
    if len(spec.canonical_json().encode()) > MAX_SPEC_BYTES:
        raise TooLarge(f"a build spec is at most {MAX_SPEC_BYTES} bytes", field="spec")
    return spec
