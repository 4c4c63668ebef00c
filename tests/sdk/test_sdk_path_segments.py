"""An id the SDK puts in a URL path is one segment: quoted, never empty and never a dot segment (an HTTP
client resolves "." and "..", so /v1/sandboxes/.. would reach /v1)."""

from __future__ import annotations

import pytest

from space.core.errors import InvalidArgument
from space.sdk import Space
from space.sdk.models import seg


@pytest.mark.parametrize("bad", ["", ".", ".."])
def test_empty_and_dot_segments_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        seg(bad)
    with Space(url="http://127.0.0.1:9", api_key="k", max_retries=0) as sp, pytest.raises(InvalidArgument):
        sp.sandboxes.ref(bad)


def test_anything_else_stays_one_segment() -> None:
    assert seg("../x") == "..%2Fx"
    assert seg("...") == "..."
    assert seg("sb-a/b?c#d") == "sb-a%2Fb%3Fc%23d"
