"""Shared pieces of the fuzz tests (tests/fuzz): the run length, JSON-ish strategies, and a tally of the
examples each target executed (printed at the end of the session by tests/fuzz/conftest.py).

`SPACE_FUZZ=long` (make fuzz) multiplies every target's example count by LONG_FACTOR; the default short
profile keeps the whole topic within a few seconds of `make test`.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st

LONG = os.environ.get("SPACE_FUZZ") == "long"
LONG_FACTOR = 100

_lock = threading.Lock()
EXECUTED: Counter[str] = Counter()


def examples(short: int) -> int:
    """The example count of a target: `short` in CI, LONG_FACTOR times as many in `make fuzz`."""
    return short * LONG_FACTOR if LONG else short


def fuzz_settings(short: int) -> settings:
    """A target's settings: the fuzz profile of this mode (tests/fuzz/conftest.py) and its example count."""
    profile = settings.get_profile("space-fuzz-long" if LONG else "space-fuzz-short")
    return settings(profile, max_examples=examples(short))


def executed(target: str) -> None:
    with _lock:
        EXECUTED[target] += 1


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
JSON: st.SearchStrategy[Any] = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=8,
)
