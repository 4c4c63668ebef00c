"""`space-template.toml`: a template build described in a file (docs/templates.md), read into the API's spec.

    name = "my-tools"
    from = "python"              # a built-in, one of the project's templates, or an OCI archive file (.tar)
    user = "user"                # optional: the default user (created if missing)
    start_cmd = "..."            # optional
    [[steps]]
    apt = ["jq"]
    [[steps]]
    file = { src = "tool.py", path = "/opt/tool.py", mode = 0o755 }   # or content = "..." inline
    [[steps]]
    run = "echo built > /etc/built"

Invariants:
- Only the keys above are read; any other key is a usage error naming it (a typo never vanishes silently).
- A file step's `src` is read relative to the TOML file's directory; the steps keep the file's order.
- `from` naming an existing file (or ending in .tar, .tar.gz, .tgz) is an OCI archive to upload.
"""

from __future__ import annotations

import base64
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from space.core.errors import InvalidArgument

TOP_KEYS: Final = frozenset({"name", "from", "user", "start_cmd", "steps"})
STEP_KEYS: Final = frozenset({"apt", "pip", "file", "run", "env", "workdir"})
FILE_KEYS: Final = frozenset({"src", "content", "path", "mode"})
ARCHIVE_SUFFIXES: Final = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class TemplateFile:
    name: str
    spec: dict[str, Any]
    archive: Path | None  # an OCI archive to upload (spec["from"] is then replaced by the SDK)


def is_archive(value: str, base: Path = Path()) -> bool:
    return value.endswith(ARCHIVE_SUFFIXES) or (base / value).is_file()


def _unknown(keys: Any, allowed: frozenset[str], where: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise InvalidArgument(
            f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})"
        )


def _file_step(raw: Any, base: Path, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}: file must be a table")
    _unknown(raw, FILE_KEYS, where)
    if ("src" in raw) == ("content" in raw):
        raise InvalidArgument(f"{where}: a file step has exactly one of src or content")
    content = (base / str(raw["src"])).read_bytes() if "src" in raw else str(raw["content"]).encode()
    return {
        "file": {
            "path": raw.get("path"),
            "content_b64": base64.b64encode(content).decode(),
            "mode": raw.get("mode", 0o644),
        }
    }


def _step(raw: Any, base: Path, index: int) -> dict[str, Any]:
    where = f"steps[{index}]"
    if not isinstance(raw, dict) or len(raw) != 1:
        raise InvalidArgument(
            f"{where}: each step is a table with exactly one of {', '.join(sorted(STEP_KEYS))}"
        )
    _unknown(raw, STEP_KEYS, where)
    if "file" in raw:
        return _file_step(raw["file"], base, where)
    return dict(raw)


def load(path: Path) -> TemplateFile:
    """The build a `space-template.toml` describes (InvalidArgument naming what is wrong)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: {exc}") from exc
    _unknown(data, TOP_KEYS, str(path))
    name, source = data.get("name"), data.get("from")
    if not isinstance(name, str) or not isinstance(source, str):
        raise InvalidArgument(f"{path}: `name` and `from` are required strings")
    base = path.parent
    steps = data.get("steps", [])
    if not isinstance(steps, list):
        raise InvalidArgument(f"{path}: steps must be an array of tables ([[steps]])")
    spec = {
        "from": source,
        "steps": [_step(step, base, i) for i, step in enumerate(steps)],
        "user": data.get("user"),
        "start_cmd": data.get("start_cmd"),
    }
    archive = base / source if is_archive(source, base) else None
    return TemplateFile(name, spec, archive)
