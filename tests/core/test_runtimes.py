"""Runtime descriptors and the restore-compatibility rule (space.core.runtimes, ADR 0035): equal fields
restore, any named difference refuses with a reason naming it, and hostile descriptors (missing fields,
wrong types, huge or odd strings, huge objects) are refused without echoing what they hold."""

from __future__ import annotations

from typing import Any

import pytest

from space.core import errors, runtimes

NODE = runtimes.describe(
    "runsc", platform="ptrace", network="sandbox", runtime_version="0.0~20240729.0",
    template_base="base-bookworm-python@v1",
)  # fmt: skip


def with_(**changes: Any) -> dict[str, Any]:
    return {**NODE, **changes}


def test_the_same_runtime_restores() -> None:
    assert runtimes.restore_problem(NODE, dict(NODE)) is None
    assert runtimes.placeable(NODE, dict(NODE))
    runtimes.check_restore(NODE, dict(NODE), what="checkpoint snap-x")


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("platform", "systrap", "gVisor platform 'systrap'"),
        ("network", "none", "network mode 'none'"),
        ("runtime_version", "0.0~20250101.0", "runtime version '0.0~20250101.0'"),
        ("template_base", "base-bookworm-python@v2", "template base 'base-bookworm-python@v2'"),
        ("driver", "fake", "isolation driver 'fake'"),
    ],
)
def test_each_difference_is_refused_with_its_reason(field: str, value: str, words: str) -> None:
    checkpoint = with_(**{field: value})
    problem = runtimes.restore_problem(NODE, checkpoint)
    assert problem is not None and words in problem, problem
    assert runtimes.first_difference(NODE, checkpoint) == field
    assert not runtimes.placeable(NODE, checkpoint)
    with pytest.raises(errors.RuntimeIncompatible) as caught:
        runtimes.check_restore(NODE, checkpoint, what="checkpoint snap-x")
    assert caught.value.code == "runtime_incompatible"
    assert caught.value.details["field"] == field and words in caught.value.details["reason"]
    assert "checkpoint snap-x cannot be restored on this node" in caught.value.message


def test_a_field_the_node_lacks_is_named_as_none() -> None:
    node = runtimes.describe("runsc")
    problem = runtimes.restore_problem(node, with_())
    assert problem is not None and "this node has none" in problem


def test_fields_the_checkpoint_leaves_out_constrain_nothing() -> None:
    assert runtimes.restore_problem(NODE, {"driver": "runsc"}) is None
    assert runtimes.restore_problem(NODE, {"driver": "runsc", "platform": None}) is None


def test_unknown_keys_are_ignored() -> None:
    assert runtimes.restore_problem(NODE, with_(future_field="x", another=[1, 2])) is None


def test_a_checkpoint_of_unknown_runtime_restores_anywhere() -> None:
    assert runtimes.restore_problem(NODE, None) is None
    assert runtimes.restore_problem(None, None) is None


def test_a_node_of_unknown_runtime_is_placeable_but_refuses_itself() -> None:
    assert runtimes.placeable(None, dict(NODE))
    problem = runtimes.restore_problem(None, dict(NODE))
    assert problem is not None and "this node's runtime is unknown" in problem


HUGE = "a" * 1_000_000


@pytest.mark.parametrize(
    ("checkpoint", "words"),
    [
        ({}, "names its driver"),
        ({"platform": "ptrace"}, "names its driver"),
        ({"driver": 7}, "driver is a int"),
        ({"driver": ["runsc"]}, "driver is a list"),
        ({"driver": "runsc", "platform": {"x": 1}}, "platform is a dict"),
        ({"driver": "runsc", "runtime_version": True}, "runtime_version is a bool"),
        ({"driver": HUGE}, "driver has 1000000 characters"),
        ({"driver": "runsc", "network": ""}, "network has 0 characters"),
        ({"driver": "runsc", "platform": "ptrace; rm -rf /"}, "platform holds characters"),
        ({"driver": "runsc\n"}, "driver holds characters"),
        ({"driver": "../../etc"}, "driver holds characters"),
        ({f"k{i}": "v" for i in range(1000)}, "at most 32 keys"),
        ("runsc", "not a str"),
        (["runsc"], "not a list"),
        (12, "not a int"),
        ("unreadable", "not a str"),
    ],
)
def test_hostile_checkpoint_descriptors_are_refused_without_echoing_them(checkpoint: Any, words: str) -> None:
    problem = runtimes.restore_problem(NODE, checkpoint)
    assert problem is not None and words in problem, problem
    assert problem.startswith("the checkpoint's runtime descriptor is unreadable")
    assert len(problem) < 200  # never the value itself
    assert not runtimes.placeable(NODE, checkpoint)
    with pytest.raises(errors.RuntimeIncompatible):
        runtimes.check_restore(NODE, checkpoint, what="checkpoint snap-x")


def test_long_but_valid_values_are_shown_cut() -> None:
    value = "v" * runtimes.MAX_VALUE_CHARS
    problem = runtimes.restore_problem(NODE, with_(runtime_version=value))
    assert problem is not None and value not in problem and "..." in problem


def test_reported_runtimes_that_cannot_be_read_are_no_report() -> None:
    assert runtimes.parse_or_none(None) is None
    assert runtimes.parse_or_none({"driver": 3}) is None
    assert runtimes.parse_or_none("runsc") is None
    assert runtimes.parse_or_none(dict(NODE)) == NODE


def test_a_writer_cannot_describe_what_a_reader_refuses() -> None:
    with pytest.raises(runtimes.MalformedDescriptor):
        runtimes.describe("runsc", platform="pt race")
    with pytest.raises(runtimes.MalformedDescriptor):
        runtimes.describe("")
