"""The configuration file of every role (TOML, `--config FILE`) and how it layers with the environment and
the command line: flags win over environment variables, which win over the file, which wins over defaults.

One file serves every role on a machine; each role reads its own sections:

    [controlplane]  `space controlplane run`: RunOptions, and every ControlPlaneSettings tunable
    [node]          `space node join`: JoinOptions, and every NodeAgentSettings tunable
    [objects]       the S3 endpoint, region and credentials of the object store (ObjectsOptions)

A key is a field name of one of its section's models; its environment variable is that field's
`validation_alias` (the tunables keep the names they always had: `SPACE_API_*`, `SPACE_NODE_*`, ...; the
object store's are the usual `AWS_*` ones). docs/operations.md ("Configuration") lists them all.

Invariants:
- There is no second settings system: the sections are the existing pydantic-settings models plus the
  roles' own options, written the same way (frozen, each field's variable is its alias). `settings()`
  builds a model with the file's values as keyword arguments minus those whose variable is set (so the
  environment wins), and the flags given as keyword arguments on top (so they win over both).
- Anything the file says that is not a setting is an error naming the file and the key: an unknown section
  or key, a nested table or array, a boolean for a non-boolean setting (`true` is never 1), a value its
  model refuses. A bad environment variable names the variable; a bad flag names the flag.
- A file holding a secret (`secret_access_key`) must be readable by its owner only.
- Sections are registered in SECTIONS; a role that adds settings adds a model there (one module).
"""

from __future__ import annotations

import os
import pathlib
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from space.controlplane.settings import ControlPlaneSettings
from space.core import errors
from space.core.node_cgroups import parse_cgroup_parent
from space.node.agent.settings import NodeAgentSettings
from space.sdk.errors import ConfigurationError

_OPTIONS: Final = SettingsConfigDict(case_sensitive=True, frozen=True, extra="ignore")
_DATABASE_PATTERN: Final = r"^(postgresql(\+psycopg)?|sqlite)://\S+$"
_LISTEN_PATTERN: Final = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$"
_PATH_PATTERN: Final = r"^/[^\x00]*$"
_URL_PATTERN: Final = r"^https?://[^\s/?#\x00]+(/[^\s\x00]*)?$"
#: Keys whose values are secrets: a file holding one must be owner-only.
SECRET_KEYS: Final = frozenset({"secret_access_key"})


class RunOptions(BaseSettings):
    """`space controlplane run`: where the replica keeps its state, serves, and finds its database."""

    model_config = _OPTIONS

    data_dir: str = Field(
        default="/var/lib/space-controlplane", pattern=_PATH_PATTERN, max_length=4096,
        validation_alias="SPACE_CONTROLPLANE_DATA_DIR",
        description="This replica's own directory: SQLite (without --database), keys, node token.",
    )  # fmt: skip
    database: str | None = Field(
        default=None, pattern=_DATABASE_PATTERN, max_length=4096, validation_alias="SPACE_DATABASE_URL",
        description="postgresql://USER@HOST/DB (replicas share it); unset: SQLite in the data directory.",
    )  # fmt: skip
    listen: str = Field(
        default="127.0.0.1:8470", pattern=_LISTEN_PATTERN, validation_alias="SPACE_CONTROLPLANE_LISTEN",
        description="ADDR:PORT the API listens on ([::1]:PORT for IPv6).",
    )  # fmt: skip
    tls_cert: str | None = Field(
        default=None, pattern=_PATH_PATTERN, max_length=4096, validation_alias="SPACE_TLS_CERT",
        description="PEM certificate (chain) the API serves HTTPS with; needs tls_key.",
    )  # fmt: skip
    tls_key: str | None = Field(
        default=None, pattern=_PATH_PATTERN, max_length=4096, validation_alias="SPACE_TLS_KEY",
        description="PEM private key of tls_cert (owner-only).",
    )  # fmt: skip
    node_token_file: str | None = Field(
        default=None, pattern=_PATH_PATTERN, max_length=4096, validation_alias="SPACE_NODE_TOKEN_FILE",
        description="The cluster's bootstrap token (replicas share it; it keys the sealing of the nodes' "
        "RPC tokens); unset: DATA_DIR/node.token, made at the first start.",
    )  # fmt: skip


class JoinOptions(BaseSettings):
    """`space node join`: where this node keeps its state, how it reaches and is reached by the control
    plane."""

    model_config = _OPTIONS

    data_dir: str = Field(
        default="/var/lib/space", pattern=_PATH_PATTERN, max_length=4096,
        validation_alias="SPACE_NODE_DATA_DIR",
        description="The node's directory: btrfs image, sandboxes, identity, logs.",
    )  # fmt: skip
    control_plane: str | None = Field(
        default=None, pattern=_URL_PATTERN, max_length=2048, validation_alias="SPACE_NODE_CONTROL_PLANE",
        description="URL of the control plane (the argument of `space node join`).",
    )  # fmt: skip
    ca_file: str | None = Field(
        default=None, pattern=_PATH_PATTERN, max_length=4096, validation_alias="SPACE_NODE_CA_FILE",
        description="PEM CA bundle that verifies the control plane's certificate (default: the system's).",
    )  # fmt: skip
    listen: str = Field(
        default="127.0.0.1:7070", pattern=_LISTEN_PATTERN, validation_alias="SPACE_NODE_LISTEN",
        description="ADDR:PORT the agent's RPC listens on (the control plane calls it).",
    )  # fmt: skip
    advertise_url: str | None = Field(
        default=None, pattern=_URL_PATTERN, max_length=2048, validation_alias="SPACE_NODE_ADVERTISE_URL",
        description="The URL the control plane calls this node at (default http://LISTEN, https://LISTEN "
        "with tls_cert).",
    )  # fmt: skip
    tls_cert: str | None = Field(
        default=None, pattern=_PATH_PATTERN, max_length=4096, validation_alias="SPACE_NODE_TLS_CERT",
        description="PEM certificate (chain) the agent's RPC serves HTTPS with; needs tls_key.",
    )  # fmt: skip
    tls_key: str | None = Field(
        default=None, pattern=_PATH_PATTERN, max_length=4096, validation_alias="SPACE_NODE_TLS_KEY",
        description="PEM private key of the node's tls_cert (owner-only).",
    )  # fmt: skip
    templates: str = Field(
        default="python", pattern=r"^[a-z0-9,_-]{0,512}$", validation_alias="SPACE_NODE_TEMPLATES",
        description="Built-in templates prepared at start (comma-separated).",
    )  # fmt: skip
    cgroup_parent: str = Field(
        default="space", max_length=256, validation_alias="SPACE_NODE_CGROUP_PARENT",
        description="The cgroup under which the node's sandboxes run (one per node on a machine).",
    )  # fmt: skip

    @field_validator("cgroup_parent")
    @classmethod
    def _cgroup_parent(cls, value: str) -> str:
        """What the node's helper takes: the one validator (space.core.node_cgroups), not a copy."""
        try:
            return parse_cgroup_parent(value)
        except errors.InvalidArgument as exc:
            raise ValueError(exc.message) from exc


class ObjectsOptions(BaseSettings):
    """The object store's S3 endpoint and credentials: boto3's usual variables, settable in the file."""

    model_config = _OPTIONS

    endpoint: str | None = Field(
        default=None, pattern=_URL_PATTERN, max_length=2048, validation_alias="AWS_ENDPOINT_URL_S3",
        description="S3-compatible endpoint (unset: AWS's).",
    )  # fmt: skip
    region: str | None = Field(
        default=None, pattern=r"^[a-z0-9-]{1,64}$", validation_alias="AWS_DEFAULT_REGION",
        description="Region (unset: us-east-1).",
    )  # fmt: skip
    access_key_id: str | None = Field(
        default=None, pattern=r"^\S{1,256}$", validation_alias="AWS_ACCESS_KEY_ID", description="Access key."
    )
    secret_access_key: str | None = Field(
        default=None, pattern=r"^\S{1,256}$", validation_alias="AWS_SECRET_ACCESS_KEY",
        description="Secret key (the file must then be owner-only).",
    )  # fmt: skip


#: Each section's models, in the order their keys are looked up (a key belongs to the first that has it).
SECTIONS: Final[dict[str, tuple[type[BaseSettings], ...]]] = {
    "controlplane": (RunOptions, ControlPlaneSettings),
    "node": (JoinOptions, NodeAgentSettings),
    "objects": (ObjectsOptions,),
}
Model = TypeVar("Model", bound=BaseSettings)


class SettingError(ConfigurationError):
    """A setting of a role is wrong (in the file, a variable or a flag: the message names which); the
    CLI's configuration error (exit code 2)."""


def env_name(model: type[BaseSettings], key: str) -> str:
    alias = model.model_fields[key].validation_alias
    return alias if isinstance(alias, str) else key


def section_keys(section: str) -> dict[str, type[BaseSettings]]:
    """Every key of `section` and the model it belongs to."""
    keys: dict[str, type[BaseSettings]] = {}
    for model in SECTIONS[section]:
        for key in model.model_fields:
            keys.setdefault(key, model)
    return keys


@dataclass(frozen=True)
class ConfigFile:
    """The checked content of a configuration file (no file: every section empty)."""

    path: pathlib.Path | None = None
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def where(self, section: str, key: str) -> str:
        return f"{self.path}: [{section}] {key}"

    def values(self, section: str) -> Mapping[str, Any]:
        return self.sections.get(section, {})


def _scalar_ok(model: type[BaseSettings], key: str, value: Any) -> bool:
    annotation = model.model_fields[key].annotation
    if isinstance(value, bool):
        return annotation is bool
    return isinstance(value, str | int | float)


def parse_config(text: str, path: pathlib.Path) -> ConfigFile:
    """Check `text` (the content of `path`): known sections and keys, scalar values each model accepts."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingError(f"{path}: not valid TOML: {exc}", field="config") from exc
    sections: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise SettingError(
                f"{path}: {section} = ... is outside any section (put it under [controlplane], [node] or "
                "[objects])",
                field=section,
            )
        if section not in SECTIONS:
            known = ", ".join(sorted(SECTIONS))
            raise SettingError(f"{path}: unknown section [{section}] (known: {known})", field=section)
        keys = section_keys(section)
        for key, value in values.items():
            where = f"{path}: [{section}] {key}"
            if key not in keys:
                raise SettingError(f"{where}: unknown key (see docs/operations.md)", field=key)
            if not _scalar_ok(keys[key], key, value):
                raise SettingError(f"{where}: {type(value).__name__} is not a valid value here", field=key)
        sections[section] = dict(values)
    config = ConfigFile(path, sections)
    for section, values in sections.items():  # every value of the file as its model checks it
        for model in SECTIONS[section]:
            mine = {key: value for key, value in values.items() if section_keys(section)[key] is model}
            _build(model, config, section, mine, {}, environ={})
    return config


def read_config(path: pathlib.Path | None) -> ConfigFile:
    """The configuration file at `path` (None: no file), checked; SettingError naming the file."""
    if path is None:
        return ConfigFile()
    try:
        info = path.stat()
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingError(f"{path}: cannot read the configuration file: {exc}") from exc
    config = parse_config(text, path)
    holds_secret = any(key in SECRET_KEYS for values in config.sections.values() for key in values)
    if holds_secret and stat.S_IMODE(info.st_mode) & 0o077:
        raise errors.PermissionDenied(
            f"{path} holds a secret but is readable by others (mode {stat.S_IMODE(info.st_mode):o}): "
            "chmod 600 it"
        )
    return config


def _build(
    model: type[Model],
    config: ConfigFile,
    section: str,
    from_file: Mapping[str, Any],
    flags: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
) -> Model:
    """`model` from the file's values (those whose variable is set in `environ` left out: the environment
    wins), the flags over them, and the process environment for the rest."""
    environ = os.environ if environ is None else environ
    given: dict[str, str] = {}  # variable -> where its value came from, for error messages
    arguments: dict[str, Any] = {}
    for key, value in from_file.items():
        name = env_name(model, key)
        if name not in environ:
            arguments[name] = (
                str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
            )
            given[name] = config.where(section, key)
    for key, value in flags.items():
        if value is not None:
            name = env_name(model, key)
            arguments[name] = value
            given[name] = f"--{key.replace('_', '-')}"
    try:
        return model(**arguments)
    except ValidationError as exc:
        problem = exc.errors(include_url=False)[0]
        if not problem["loc"]:  # a rule between fields (e.g. fence grace below node-lost time)
            where = f"{config.path}: [{section}]" if config.path else f"settings of [{section}]"
            raise SettingError(f"{where}: {problem['msg'].removeprefix('Value error, ')}") from exc
        name = str(problem["loc"][0])
        origin = given.get(name, f"environment variable {name}")
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "string_pattern_mismatch":  # the pattern itself helps no one
            key = next((k for k in model.model_fields if env_name(model, k) == name), name)
            message = f"{problem['input']!r} is not valid: {model.model_fields[key].description}"
        raise SettingError(f"{origin}: {message}", field=name) from exc


def settings(model: type[Model], config: ConfigFile, section: str, **flags: Any) -> Model:
    """`model` as this process sees it: the file's `section`, overridden by the environment, overridden
    by `flags` (field name -> value; None: not given)."""
    keys = section_keys(section)
    from_file = {key: value for key, value in config.values(section).items() if keys[key] is model}
    return _build(model, config, section, from_file, flags)


def export_to_environment(config: ConfigFile, section: str, model: type[BaseSettings]) -> dict[str, str]:
    """Put the file's values of `model` into this process's environment where the variable is unset
    (the environment wins), so that processes started from here read them as their own variables; the
    variables set."""
    keys = section_keys(section)
    exported: dict[str, str] = {}
    for key, value in config.values(section).items():
        if keys[key] is not model:
            continue
        name = env_name(model, key)
        if name not in os.environ:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            os.environ[name] = exported[name] = text
    return exported
