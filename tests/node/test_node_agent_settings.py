"""NodeAgentSettings: the node agent's environment variables keep their names, the new ones their prefix,
and every default is the value the agent had before the settings existed."""

from __future__ import annotations

import pathlib

import pytest

from space.core.settings import DiskReserve
from space.node.agent import launch
from space.node.agent.settings import NodeAgentSettings


def test_defaults_are_the_agents_former_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPACE_STORE_URL", "SPACE_DISK_RESERVE", "SPACE_ROOTFS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    settings = NodeAgentSettings()
    assert settings.store_url is None and settings.rootfs_cache is None
    assert settings.disk_reserve == "5,2048"
    assert settings.read_window_bytes == 4 << 20
    assert (settings.guest_info_timeout_s, settings.settle_timeout_s, settings.cancel_grace_s) == (2, 120, 5)
    assert settings.pty_hangup_grace_s == (0.5, 1.0, 2.0)
    assert (settings.heartbeat_interval_s, settings.control_plane_timeout_s) == (2.0, 10.0)
    assert settings.idempotency_memory == 1024
    assert (settings.helper_start_timeout_s, settings.helper_pool_size, settings.helper_call_timeout_s) == (
        30.0,
        8,
        120.0,
    )


def test_existing_variable_names_are_read_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACE_STORE_URL", "file:///srv/objects")
    monkeypatch.setenv("SPACE_DISK_RESERVE", "1,100")
    monkeypatch.setenv("SPACE_ROOTFS_CACHE", "/var/cache/space")
    settings = NodeAgentSettings()
    assert settings.store_url == "file:///srv/objects"
    assert settings.disk_reserve == "1,100"
    assert settings.rootfs_cache == "/var/cache/space"
    # Matched as os.environ matched them: case-sensitively, and without the new prefix.
    monkeypatch.delenv("SPACE_STORE_URL")
    monkeypatch.setenv("space_store_url", "file:///lower")
    monkeypatch.setenv("SPACE_NODE_STORE_URL", "file:///prefixed")
    assert NodeAgentSettings().store_url is None


def test_new_tunables_take_the_node_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACE_NODE_SETTLE_TIMEOUT_S", "7.5")
    monkeypatch.setenv("SPACE_NODE_PTY_HANGUP_GRACE_S", "[1, 3]")
    monkeypatch.setenv("SPACE_NODE_HELPER_POOL_SIZE", "2")
    settings = NodeAgentSettings()
    assert settings.settle_timeout_s == 7.5
    assert settings.pty_hangup_grace_s == (1.0, 3.0)
    assert settings.helper_pool_size == 2
    assert NodeAgentSettings(settle_timeout_s=1.0).settle_timeout_s == 1.0  # keyword arguments win


def test_the_flags_default_to_the_environment_and_win_over_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, object]] = []

    async def fake_serve(*_args: object, **kwargs: object) -> None:
        seen.append(kwargs)

    monkeypatch.setattr(launch, "serve", fake_serve)
    monkeypatch.setenv("SPACE_STORE_URL", "file:///from-env")
    monkeypatch.setenv("SPACE_DISK_RESERVE", "2,200")
    launch.main(["--data-dir", str(tmp_path), "--driver", "fake"])
    assert seen[-1]["store_url"] == "file:///from-env"
    assert seen[-1]["disk_reserve"] == DiskReserve(percent=2.0, mb=200)
    launch.main(["--data-dir", str(tmp_path), "--driver", "fake", "--store-url", "file:///flag"])
    assert seen[-1]["store_url"] == "file:///flag"
