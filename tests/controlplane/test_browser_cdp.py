"""A `browser` sandbox on a real node (runsc): Playwright over CDP through SPACE, SDK screenshots, and who may
connect (ADR 0064).

The page is served inside the sandbox (python3 -m http.server on its loopback), so no traffic leaves the
machine. The template's package layer (Chromium from the machine's Debian mirror) is built once per machine
and cached under /var/cache/space/rootfs; later runs receive it in seconds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import sync_playwright
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from space.core.errors import InvalidArgument, InvalidState, NotFound
from space.sdk import Sandbox, Space
from tests.support import cluster as c
from tests.support.mcp_clients import over_http

pytestmark = pytest.mark.root

real_cluster = c.real_cluster

TITLE = "SPACE browser " + secrets.token_hex(4)
PAGE = f"<!doctype html><title>{TITLE}</title><h1 style='font-size:80px'>hello from the sandbox</h1>"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def browser_sandbox(real_cluster: c.RealCluster) -> Iterator[Sandbox]:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="browser", limits={"cpus": 1, "memory_mb": 1024})
        try:
            sb.files.write("/work/index.html", PAGE.encode())
            sb.processes.start("exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /work")
            yield sb
        finally:
            sb.delete()


def test_playwright_over_cdp_through_space_reads_a_page_served_in_the_sandbox(
    real_cluster: c.RealCluster, browser_sandbox: Sandbox
) -> None:
    sb = browser_sandbox
    headers = sb.browser.cdp_headers()
    # The HTTP form: Playwright asks /json/version, whose webSocketDebuggerUrl SPACE rewrote to its own.
    http_endpoint = f"{real_cluster.url}/v1/sandboxes/{sb.id}/cdp"
    version = httpx.get(f"{http_endpoint}/json/version", headers=headers, timeout=60)
    assert version.status_code == 200, version.text
    assert version.json()["webSocketDebuggerUrl"] == sb.browser.cdp_url()
    assert "Chrome" in version.json()["Browser"]
    with sync_playwright() as pw:
        for endpoint in (http_endpoint, sb.browser.cdp_url()):
            browser = pw.chromium.connect_over_cdp(endpoint, headers=headers, timeout=60_000)
            page = browser.contexts[0].new_page()
            page.goto("http://127.0.0.1:8000/")
            assert page.title() == TITLE
            assert page.inner_text("h1") == "hello from the sandbox"
            page.close()
            browser.close()


def test_sdk_and_mcp_screenshots_are_pngs_of_the_page(
    real_cluster: c.RealCluster, browser_sandbox: Sandbox
) -> None:
    for bad in ("", "x" * 8193, "http://127.0.0.1:8000/\r\nX-Injected: 1"):
        with pytest.raises(InvalidArgument):
            browser_sandbox.browser.screenshot(bad)
    png = browser_sandbox.browser.screenshot("http://127.0.0.1:8000/")
    assert png.startswith(PNG_MAGIC)
    assert len(png) > 2000  # a rendered page with large text, not an empty image
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 100 and height > 100

    async def through_mcp() -> list[Any]:
        async with over_http(real_cluster.url, real_cluster.api_key) as mcp:
            answer = await mcp.client.call_tool(
                "screenshot", {"id": browser_sandbox.id, "url": "http://127.0.0.1:8000/"}
            )
            assert not answer.is_error, answer
            return list(answer.content)

    [image] = asyncio.run(through_mcp())
    assert image.type == "image" and image.mime_type == "image/png"
    assert base64.b64decode(image.data).startswith(PNG_MAGIC)


def test_another_tenant_and_no_key_cannot_connect(
    real_cluster: c.RealCluster, browser_sandbox: Sandbox
) -> None:
    admin = httpx.Client(
        base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}, timeout=60
    )
    name = f"cdp-other-{secrets.token_hex(3)}"
    assert admin.post("/v1/projects", json={"name": name}).status_code == 201
    made = admin.post("/v1/keys", json={"project": name, "role": "admin"})
    assert made.status_code == 201, made.text
    other = {"Authorization": f"Bearer {made.json()['key']}"}
    url = browser_sandbox.browser.cdp_url()
    refused = {}
    for who, headers in (("other tenant", other), ("no key", {})):
        with pytest.raises(InvalidStatus) as caught:
            connect(url, additional_headers=headers, open_timeout=30).close()
        refused[who] = caught.value.response.status_code
        version = httpx.get(f"{real_cluster.url}/v1/sandboxes/{browser_sandbox.id}/cdp/json/version",
                            headers=headers, timeout=60)  # fmt: skip
        refused[f"{who} /json/version"] = version.status_code
    assert refused == {
        "other tenant": 404, "other tenant /json/version": 404, "no key": 401, "no key /json/version": 401,
    }  # fmt: skip
    # Through the SDK, the other tenant's screenshot is the typed 404 of a missing sandbox.
    with Space(url=real_cluster.url, api_key=made.json()["key"]) as sp, pytest.raises(NotFound):
        sp.sandboxes.ref(browser_sandbox.id).browser.screenshot("data:text/html,x", timeout=30)


def test_a_sandbox_without_a_browser_is_a_typed_conflict(real_cluster: c.RealCluster) -> None:
    with real_cluster.sdk() as sp:
        sb = sp.sandboxes.create(template="python", limits={"cpus": 0.5, "memory_mb": 256})
        try:
            version = httpx.get(
                f"{real_cluster.url}/v1/sandboxes/{sb.id}/cdp/json/version",
                headers=sb.browser.cdp_headers(), timeout=60,
            )  # fmt: skip
            assert version.status_code == 409 and version.json()["error"]["code"] == "invalid_state"
            assert "browser" in version.json()["error"]["message"]
            frames = []
            ws = connect(sb.browser.cdp_url(), additional_headers=sb.browser.cdp_headers())
            with ws, contextlib.suppress(ConnectionClosed):
                while True:
                    frames.append(json.loads(ws.recv(timeout=60)))
            assert ws.close_code == 4409
            assert [f["error"]["code"] for f in frames] == ["invalid_state"]
            with pytest.raises(InvalidState):
                sb.browser.screenshot("data:text/html,x", timeout=30)
        finally:
            sb.delete()
