"""The page fill's CDP conversation and page script (space.core.cdp_login, ADR 0066) against a real
Chromium (Debian's, on the host) and pages that try to trip it: inputs that clobber the form's properties,
a form that GETs, posts to another origin or path, a missing field or form, a page that tracks typing.
The pages are served over TLS by this test; Chromium resolves login.test and other.test to it. No SPACE
component runs here: the API around it is tests/controlplane/test_browser_login.py, the whole chain with
the egress gateway tests/e2e/test_browser_login_e2e.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import pathlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
from websockets.asyncio.client import connect

from space.core import errors
from space.core.cdp_conversation import Conversation
from space.core.cdp_login import FILL_SCRIPT, LoginFill, LoginForm, fill_login, fill_script, origin_of
from space.node.agent.egress_sandbox import chromium_egress_policy
from tests.support.egress_net import UpstreamCA

pytestmark = pytest.mark.root  # Chromium with --no-sandbox, as root

CHROMIUM = "/usr/bin/chromium"
PLACEHOLDERS = ("space-user-site-abc", "space-cred-site-abc")
FORM_TAIL = "<input name='user'><input type='password' name='pass'><button>Sign in</button></form>"
PAGES = {
    "/plain": "<form method='post' action='/session'>" + FORM_TAIL,
    # Inputs named like the form's properties shadow them (DOM clobbering): action, method, requestSubmit.
    "/clobber": "<form method='post' action='/session'><input name='action' value='https://other.test/x'>"
    "<input name='method' value='get'><input name='requestSubmit'>" + FORM_TAIL,
    "/get": "<form method='get' action='/session'>" + FORM_TAIL,
    "/elsewhere": "<form method='post' action='https://other.test:{port}/session'>" + FORM_TAIL,
    "/other-path": "<form method='post' action='/comments'>" + FORM_TAIL,
    "/no-user": "<form method='post' action='/session'><input type='password' name='pass'></form>",
    "/no-form": "<input name='user'><input type='password' name='pass'>",
    # Typing as a user's: the page's listeners see input and change events with the value set.
    "/tracked": "<form method='post' action='/session'>" + FORM_TAIL + "<script>"
    "var seen = [];"
    "document.addEventListener('input', function (e) {"
    "  seen.push('input:' + e.target.name + '=' + e.target.value); });"
    "document.addEventListener('change', function (e) { seen.push('change:' + e.target.name); });"
    "document.forms[0].addEventListener('submit', function (e) {"
    "  e.preventDefault(); document.title = seen.join(' '); });"
    "</script>",
}


@dataclass
class Site:
    port: int
    posts: list[tuple[str, str]] = field(default_factory=list)  # (host, body)

    def origin(self, host: str = "login.test") -> str:
        return f"https://{host}:{self.port}"


@dataclass
class Browser:
    ws_url: str
    site: Site


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-login-script-"))
    cert = UpstreamCA(workdir).issue("site.pem", ["login.test", "other.test"], ["127.0.0.1"])
    site = Site(free_port())

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _answer(self, body: str) -> None:
            data = ("<!doctype html><title>page</title>" + body).encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(PAGES.get(self.path, "none").replace("{port}", str(site.port)))

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
            site.posts.append((self.headers.get("host", ""), body))
            self._answer("<h1>posted</h1>")

    server = ThreadingHTTPServer(("127.0.0.1", site.port), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    debug_port = free_port()
    chromium = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={workdir / 'profile'}",
         f"--remote-debugging-port={debug_port}", "--remote-debugging-address=127.0.0.1",
         "--host-resolver-rules=MAP login.test 127.0.0.1, MAP other.test 127.0.0.1",
         "--ignore-certificate-errors", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{debug_port}/json/version", timeout=5) as r:
                    ws_url = json.load(r)["webSocketDebuggerUrl"]
                break
            except OSError:
                if time.monotonic() > deadline or chromium.poll() is not None:
                    raise
                time.sleep(0.2)
        yield Browser(ws_url, site)
    finally:
        chromium.terminate()
        try:
            chromium.wait(10)
        except subprocess.TimeoutExpired:
            chromium.kill()
            chromium.wait(10)
        server.shutdown()
        server.server_close()
        shutil.rmtree(workdir, ignore_errors=True)


def form(site: Site, **kw: Any) -> LoginForm:
    values: dict[str, Any] = {
        "origin": site.origin(), "username_field": "user", "password_field": "pass", "form_action": "/session"
    } | kw  # fmt: skip
    return LoginForm(**values)


async def _until_loaded_at(cdp: Conversation, session: str, url: str) -> None:
    expression = {"expression": "location.href + ' ' + document.readyState", "returnByValue": True}
    while True:
        answer = await cdp.call("Runtime.evaluate", expression, session=session)
        if answer["result"]["value"] == f"{url} complete":
            return
        await asyncio.sleep(0.05)


async def _fill(b: Browser, url: str, login: LoginForm, *, target: bool = False) -> tuple[LoginFill, str]:
    """Open `url` in a page of its own, run the fill on it, close it; (the answer, the page's target)."""
    async with connect(b.ws_url, max_size=None) as ws:
        cdp = Conversation(ws.send, ws.recv)
        page = (await cdp.call("Target.createTarget", {"url": "about:blank"}))["targetId"]
        try:
            session = (await cdp.call("Target.attachToTarget", {"targetId": page, "flatten": True}))[
                "sessionId"
            ]
            await cdp.call("Page.enable", session=session)
            await cdp.call("Page.navigate", {"url": url}, session=session)
            # Not the next load event: on a busy machine it can be the initial about:blank's, late.
            await asyncio.wait_for(_until_loaded_at(cdp, session, url), 30)
            done = await asyncio.wait_for(
                fill_login(ws.send, ws.recv, login, PLACEHOLDERS, target_id=page if target else None,
                           navigation=lambda: asyncio.timeout(3)),
                30,
            )  # fmt: skip
            return done, page
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(cdp.call("Target.closeTarget", {"targetId": page}), 10)


def fill(b: Browser, path: str, login: LoginForm | None = None, **kw: Any) -> LoginFill:
    return asyncio.run(_fill(b, b.site.origin() + path, login or form(b.site), **kw))[0]


def test_the_form_is_filled_and_posted_to_its_origin(browser: Browser) -> None:
    site = browser.site
    before = len(site.posts)
    done = fill(browser, "/plain", target=True)
    assert done.navigated and done.url == site.origin() + "/session" and done.title == "page", done
    assert site.posts[before:] == [
        (f"login.test:{site.port}", "user=space-user-site-abc&pass=space-cred-site-abc")
    ]
    # A form whose inputs clobber action, method and requestSubmit: still the form's own attributes.
    done = fill(browser, "/clobber")
    assert done.navigated, done
    host, body = site.posts[-1]
    assert host == f"login.test:{site.port}"
    assert parse_qs(body)["user"] == [PLACEHOLDERS[0]] and parse_qs(body)["pass"] == [PLACEHOLDERS[1]]


def test_typing_is_seen_by_the_pages_listeners(browser: Browser) -> None:
    done = fill(browser, "/tracked")
    assert not done.navigated  # the page's submit handler kept the page (and wrote what it saw)
    assert done.title == (
        f"input:user={PLACEHOLDERS[0]} change:user input:pass={PLACEHOLDERS[1]} change:pass"
    ), done.title


@pytest.mark.parametrize(
    ("path", "kind", "message"),
    [
        ("/get", errors.Conflict, "not POST"),
        ("/elsewhere", errors.Conflict, "not to the credential's origin"),
        ("/other-path", errors.Conflict, "not to the credential's form_action"),
        ("/no-user", errors.NotFound, "no input named 'user'"),
        ("/no-form", errors.NotFound, "in no form"),
    ],
)
def test_forms_that_would_misdirect_the_placeholders_are_refused_untouched(
    browser: Browser, path: str, kind: type[errors.SpaceError], message: str
) -> None:
    before = len(browser.site.posts)
    with pytest.raises(kind) as caught:
        fill(browser, path)
    assert message in caught.value.message, caught.value.message
    assert len(browser.site.posts) == before


def test_a_page_of_another_origin_is_never_filled(browser: Browser) -> None:
    site = browser.site
    before = len(site.posts)
    with pytest.raises(errors.Conflict, match="no page of the browser is on"):
        asyncio.run(_fill(browser, site.origin("other.test") + "/plain", form(site)))
    with pytest.raises(errors.Conflict, match="not on the credential's origin"):
        asyncio.run(_fill(browser, site.origin("other.test") + "/plain", form(site), target=True))
    # Another port of the same host is another origin too.
    with pytest.raises(errors.Conflict):
        fill(browser, "/plain", form(site, origin="https://login.test"), target=True)
    assert len(site.posts) == before


def test_names_and_placeholders_are_data_not_code() -> None:
    hostile = LoginForm("https://login.test", "u')])||alert(1)//<b>", "p`${alert(2)}`</script>'\u2028", None)
    script = fill_script(hostile, ('a"b', "c'd"))
    assert script.startswith(FILL_SCRIPT + "(") and script.endswith(")")
    data = json.loads(script[len(FILL_SCRIPT) + 1 : -1])
    assert (
        data["username_field"] == hostile.username_field and data["password_field"] == hostile.password_field
    )
    assert data["username"] == 'a"b' and data["form_action"] is None
    assert script.isascii()  # U+2028 and the like are escaped: a JSON text is a JavaScript expression


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("https://login.test/login", "https://login.test"),
        ("https://login.test:443/", "https://login.test"),
        ("https://login.test:8443?next=/", "https://login.test:8443"),
        ("https://login.test", "https://login.test"),
        ("https://login.test.evil.test/", "https://login.test.evil.test"),
        ("http://login.test/", None),
        ("https://login.test@evil.test/", None),
        ("https://user:pw@login.test/", None),
        ("https://[::1]/", None),
        ("about:blank", None),
        ("chrome-error://chromewebdata/", None),
    ],
)
def test_the_origin_of_a_page_url(url: str, origin: str | None) -> None:
    assert origin_of(url) == origin


def test_the_nodes_chromium_policy_trusts_its_ca_and_turns_ech_off(tmp_path: pathlib.Path) -> None:
    """What the node writes into a browser sandbox with egress (ADR 0066); that Chromium honours it is
    tests/e2e/test_browser_login_e2e.py (every page there is intercepted or refused without it)."""
    ca = UpstreamCA(tmp_path).ca_file.read_bytes()
    policy = json.loads(chromium_egress_policy(ca))
    assert policy["EncryptedClientHelloEnabled"] is False
    [der] = policy["CACertificates"]
    assert base64.b64decode(der) == ssl.PEM_cert_to_DER_cert(ca.decode())
