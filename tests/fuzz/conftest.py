"""Hypothesis profiles of the fuzz topic: `short` (make test: small example counts, each target's own
`examples(n)`) and `long` (SPACE_FUZZ=long, make fuzz: LONG_FACTOR times as many). Both bound the time of
one example (`deadline`: an input that makes a parser hang fails), write no example database into the
tree, and print how many examples each target executed. The profiles are not loaded globally (other
topics keep hypothesis' defaults): each target takes them as the parent of its settings
(tests/support/fuzzing.py `fuzz_settings`)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

from tests.support.fuzzing import EXECUTED, LONG

settings.register_profile(
    "space-fuzz-short",
    deadline=timedelta(seconds=20),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "space-fuzz-long",
    deadline=timedelta(seconds=20),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if EXECUTED:
        mode = "long" if LONG else "short"
        lines = [f"  {target}: {count}" for target, count in sorted(EXECUTED.items())]
        terminalreporter.write_line(
            f"fuzz examples executed ({mode} profile), {sum(EXECUTED.values())} in all:"
        )
        for line in lines:
            terminalreporter.write_line(line)
