"""Where a client finds its server and key.

Resolution, per field, first match wins:
1. the arguments given to Space(url=..., api_key=...);
2. the environment: SPACE_URL, SPACE_API_KEY;
3. the config file `space up` writes: $SPACE_CONFIG, else ~/.config/space/config.json,
   JSON {"url", "api_key"}.

Invariant: the file's api_key is used only when the resolved url is the file's url, so pointing SPACE_URL
at another server never sends it the local admin key.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from space.sdk.errors import ConfigurationError

__all__ = ["ClientConfig", "config_path", "load_config_file", "resolve_config", "write_config_file"]


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str | None
    source: str  # "arguments", "environment" or the config file's path: where the url came from


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """The config file to read (and the one `space up` should write)."""
    environ = os.environ if env is None else env
    explicit = environ.get("SPACE_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    return Path(environ.get("HOME") or Path.home()) / ".config" / "space" / "config.json"


def load_config_file(path: Path) -> dict[str, str]:
    """The file's {"url", "api_key"} (only string values kept); {} if it does not exist."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {path}: {exc}", path=str(path)) from exc
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigurationError(f"config file {path} is not valid JSON: {exc}", path=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigurationError(f"config file {path} must hold a JSON object", path=str(path))
    return {k: v for k, v in data.items() if k in {"url", "api_key"} and isinstance(v, str) and v}


def write_config_file(url: str, api_key: str, path: Path | None = None) -> Path:
    """Write the config file (mode 0600) the way resolve_config reads it; returns its path."""
    target = path or config_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own per writer: `space up --detach` and the server it starts both write this file.
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"url": url, "api_key": api_key}, handle)
        handle.write("\n")
    os.replace(tmp, target)
    return target


def _norm(url: str) -> str:
    return url.strip().rstrip("/")


def resolve_config(
    url: str | None = None,
    api_key: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    path: Path | None = None,
) -> ClientConfig:
    environ = os.environ if env is None else env
    file_path = path or config_path(environ)
    file: dict[str, str] | None = None

    def from_file() -> dict[str, str]:
        nonlocal file
        if file is None:
            file = load_config_file(file_path)
        return file

    source = "arguments"
    resolved_url = url
    if not resolved_url and environ.get("SPACE_URL"):
        resolved_url, source = environ["SPACE_URL"], "environment"
    if not resolved_url and from_file().get("url"):
        resolved_url, source = from_file()["url"], str(file_path)
    if not resolved_url:
        raise ConfigurationError(
            "no server configured: set SPACE_URL and SPACE_API_KEY, run `space up`, "
            f'or write {file_path} as {{"url": ..., "api_key": ...}}'
        )
    resolved_url = _norm(resolved_url)
    if not resolved_url.startswith(("http://", "https://")):
        raise ConfigurationError(f"server url must start with http:// or https://, not {resolved_url!r}")
    key = api_key or environ.get("SPACE_API_KEY") or None
    if key is None:
        file_url = from_file().get("url")
        if file_url and _norm(file_url) == resolved_url:
            key = from_file().get("api_key")
    return ClientConfig(url=resolved_url, api_key=key, source=source)
