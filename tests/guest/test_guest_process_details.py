"""process.list shows each process's working directory, and the variables its start asked for only when
the host asks (`{"env": true}`): never the inherited environment, never by default."""

from __future__ import annotations

from pathlib import Path

from tests.support.guest_harness import Guest


def _listed(guest: Guest, process_id: str, params: dict[str, object]) -> dict[str, object]:
    processes = guest.call("process.list", params).result["processes"]
    return next(p for p in processes if p["process_id"] == process_id)


def test_list_shows_cwd_and_requested_env_on_request(guest: Guest, tmp_path: Path) -> None:
    started = guest.call(
        "process.start",
        {"argv": ["sleep", "30"], "background": True, "env": {"ASKED": "yes"}, "cwd": str(tmp_path)},
    ).result
    try:
        plain = _listed(guest, started["process_id"], {})
        assert plain["cwd"] == str(tmp_path) and "env" not in plain
        detailed = _listed(guest, started["process_id"], {"env": True})
        assert detailed["env"] == {"ASKED": "yes"}  # what the start asked for, not PATH, HOME, ...
        assert detailed["cwd"] == str(tmp_path)
        assert guest.call("process.list", {"env": "yes"}).error["code"] == "invalid_argument"
    finally:
        guest.call("process.signal", {"process_id": started["process_id"], "signal": "KILL"})
