"""Fixtures of the guest tests. `guest`: the guest daemon in process behind a socket pair
(tests/support/guest_harness.py), one per test module; a module that needs another scope or
parameters defines its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.guest_harness import Guest


@pytest.fixture(scope="module")
def guest() -> Iterator[Guest]:
    g = Guest()
    yield g
    g.close()
