"""spaced's settings: each environment variable, its default, and what processes inherit."""

from __future__ import annotations

import pytest

from space.guest import settings
from space.guest.settings import GuestSettings


def test_defaults_without_variables() -> None:
    assert GuestSettings.from_environ({}) == GuestSettings(
        workdir="/work", log_path=None, reap_all=False, watch_poll=False, user=None, sudo_socket="space-sudo"
    )


def test_each_variable() -> None:
    found = GuestSettings.from_environ(
        {
            "SPACED_WORKDIR": "/srv/work",
            "SPACED_LOG": "/tmp/spaced.log",
            "SPACED_REAP_ALL": "1",
            "SPACED_WATCH_POLL": "1",
            "SPACED_USER": "user",
            "SPACED_SUDO_SOCKET": "sudo-test",
        }
    )
    assert found == GuestSettings("/srv/work", "/tmp/spaced.log", True, True, "user", "sudo-test")


def test_flags_are_on_only_for_1_and_an_empty_log_is_none() -> None:
    found = GuestSettings.from_environ({"SPACED_REAP_ALL": "yes", "SPACED_WATCH_POLL": "0", "SPACED_LOG": ""})
    assert (found.reap_all, found.watch_poll, found.log_path) == (False, False, None)


def test_processes_inherit_neither_spaced_variables_nor_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACED_LOG", "/tmp/x")
    monkeypatch.setenv("PYTHONPATH", "/opt/space/lib")
    monkeypatch.setenv("WORKLOAD_VAR", "kept")
    inherited = settings.inherited_environment()
    assert inherited["WORKLOAD_VAR"] == "kept"
    assert "PYTHONPATH" not in inherited
    assert not any(key.startswith("SPACED_") for key in inherited)
