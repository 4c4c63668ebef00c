"""What a holder writes into its sandbox's run directory (`holder.json`, `exit.json`): JSON without the `json`
module while the sandbox runs, and how often the host enforced the sandbox's limits, read as it ends.

Invariants:
- Standard library only and importable by its directory, like the holder itself (space.node.helper.holder),
  which loads it beside every sandbox: nothing heavy at import; `json` is imported only once the runtime
  has ended (`limit_events`).
- Cgroup paths come from the sandbox's bundle, and one that is not absolute or climbs out of the hierarchy
  gives no counters (ADR 0036).
"""

from __future__ import annotations

import os


def _json_string(text: str) -> str:
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def to_json(value: object) -> str:
    """JSON for the few shapes the holder writes (numbers, strings, lists of strings, flat dicts), without
    importing `json` while the sandbox runs."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _json_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(to_json(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_json_string(str(k))}: {to_json(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot encode {type(value).__name__}")


def write_json(path: str, value: dict[str, object]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(to_json(value))
    os.replace(tmp, path)


CGROUP_ROOT = "/sys/fs/cgroup"


def _counter(path: str, key: str) -> int | None:
    """The value of `key` in a cgroup file of `key value` lines (None if unreadable)."""
    try:
        with open(path) as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


def limit_events(argv: list[str]) -> dict[str, int]:
    """How often the host enforced the sandbox's limits while the runtime of `argv` ran (cgroup v1 or v2;
    empty when its cgroup cannot be found). Called once the runtime has ended, so `json` is imported here."""
    import json

    bundle = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--bundle=")), None)
    if bundle is None:
        return {}
    try:
        with open(os.path.join(bundle, "config.json")) as handle:
            cgroup = json.load(handle)["linux"]["cgroupsPath"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(cgroup, str) or not cgroup.startswith("/") or ".." in cgroup.split("/"):
        return {}
    sources = {
        "oom_kills": [
            (f"memory{cgroup}/memory.oom_control", "oom_kill"),
            (f"{cgroup[1:]}/memory.events", "oom_kill"),
        ],
        "task_limit_hits": [(f"pids{cgroup}/pids.events", "max"), (f"{cgroup[1:]}/pids.events", "max")],
    }
    found: dict[str, int] = {}
    for name, places in sources.items():
        for relative, key in places:
            value = _counter(os.path.join(CGROUP_ROOT, relative), key)
            if value is not None:
                found[name] = value
                break
    return found
