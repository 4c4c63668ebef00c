"""Tests of the settings models (space.core.settings)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pydantic
import pytest

from space.core import errors
from space.core.settings import NodeSettings, SandboxLimits, parse_limits, parse_node_settings

# field -> (minimum, maximum, default), from the brief
BOUNDS: dict[str, tuple[float, float, float]] = {
    "cpus": (0.1, 64.0, 1.0),
    "memory_mb": (64, 65536, 512),
    "pids": (16, 65536, 512),
    "disk_mb": (64, 1048576, 2048),
}


def test_defaults() -> None:
    limits = SandboxLimits()
    for field, (_, _, default) in BOUNDS.items():
        assert getattr(limits, field) == default
    assert parse_limits(None) == limits
    assert parse_limits({}) == limits


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_bounds_are_inclusive(field: str) -> None:
    low, high, _ = BOUNDS[field]
    cast = float if field == "cpus" else int
    assert getattr(parse_limits({field: cast(low)}), field) == low
    assert getattr(parse_limits({field: cast(high)}), field) == high
    step = 0.01 if field == "cpus" else 1
    for bad in (cast(low - step), cast(high + step)):
        with pytest.raises(errors.InvalidArgument) as info:
            parse_limits({field: bad})
        assert info.value.message.startswith(f"invalid limits: {field}: ")
        assert info.value.details["errors"][0]["field"] == field


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"cpus": True}, "cpus"),
        ({"cpus": "2"}, "cpus"),
        ({"cpus": math.nan}, "cpus"),
        ({"cpus": math.inf}, "cpus"),
        ({"memory_mb": "512"}, "memory_mb"),
        ({"memory_mb": 512.5}, "memory_mb"),
        ({"memory_mb": 512.0}, "memory_mb"),
        ({"pids": False}, "pids"),
        ({"disk_mb": None}, "disk_mb"),
        ({"memroy_mb": 512}, "memroy_mb"),
    ],
)
def test_wrong_types_and_unknown_fields_are_rejected(data: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        parse_limits(data)
    assert [e["field"] for e in info.value.details["errors"]] == [field]
    assert field in info.value.message


def test_every_bad_field_is_reported() -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        parse_limits({"cpus": 0, "pids": 1})
    assert {e["field"] for e in info.value.details["errors"]} == {"cpus", "pids"}


def test_integer_cpus_are_accepted_as_float() -> None:
    assert parse_limits({"cpus": 2}).cpus == 2.0


def test_limits_are_frozen() -> None:
    limits = SandboxLimits()
    with pytest.raises(pydantic.ValidationError):
        limits.cpus = 4.0


def test_node_settings_defaults_and_nesting() -> None:
    node = NodeSettings()
    assert node.platform == "ptrace"
    assert node.runsc_binary == "runsc"
    assert node.data_dir.is_absolute() and node.helper_socket.is_absolute()
    assert node.default_limits == SandboxLimits()
    custom = parse_node_settings(
        {"data_dir": "/srv/space", "platform": "ptrace", "default_limits": {"memory_mb": 1024}}
    )
    assert custom.data_dir == Path("/srv/space")
    assert custom.default_limits.memory_mb == 1024


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"data_dir": "relative/dir"}, "data_dir"),
        ({"helper_socket": "helper.sock"}, "helper_socket"),
        ({"platform": "kvm"}, "platform"),
        ({"runsc_binary": "runsc --debug"}, "runsc_binary"),
        ({"runsc_binary": "../bin/runsc"}, "runsc_binary"),
        ({"runsc_binary": "/usr/../tmp/runsc"}, "runsc_binary"),
        ({"runsc_binary": ""}, "runsc_binary"),
        ({"runsc_binary": "runsc;rm"}, "runsc_binary"),
        ({"default_limits": {"cpus": 100}}, "default_limits.cpus"),
        ({"datadir": "/x"}, "datadir"),
    ],
)
def test_bad_node_settings_name_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        parse_node_settings(data)
    assert [e["field"] for e in info.value.details["errors"]] == [field]
    assert "Value error" not in info.value.message


@pytest.mark.parametrize("binary", ["runsc", "/usr/bin/runsc", "/opt/gvisor/runsc-2024.07"])
def test_good_runsc_binaries(binary: str) -> None:
    assert parse_node_settings({"runsc_binary": binary}).runsc_binary == binary
