"""The E2B front answers request ids as SPACE's API does (ADR 0071): the caller's valid `X-Request-Id`, or
a new one in place of a missing or hostile value; on both of its servers."""

from __future__ import annotations

import httpx
import pytest

from tests.support.e2b_cluster import E2bCluster


@pytest.mark.parametrize("which", ["api_url", "sandbox_url"])
def test_both_e2b_servers_answer_a_request_id(e2b_fake: E2bCluster, which: str) -> None:
    url = getattr(e2b_fake, which) + "/health"
    assert httpx.get(url, headers={"X-Request-Id": "e2b-call.1"}).headers["x-request-id"] == "e2b-call.1"
    for hostile in ('x","level":"error', "a" * 10_000, "bad id"):
        made = httpx.get(url, headers={"X-Request-Id": hostile}).headers["x-request-id"]
        assert made.startswith("req_") and len(made) == 20
