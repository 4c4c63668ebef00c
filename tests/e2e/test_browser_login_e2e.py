"""Issue 14's login, end to end on real components (ADR 0063, 0066): a `browser` sandbox (runsc, Chromium)
behind the node's egress gateway logs in to a site served by this test over TLS in a network namespace of
its own (`login.test`, tests/support/egress_upstream.py's /login and /session), with a `login` credential.

- SPACE fills the open login page's form with placeholders (POST /v1/sandboxes/{id}/browser/login) and
  the gateway writes the real username and password into that origin's submission: the site receives
  them and answers "Signed in", which the page shows.
- The password and username are then searched for, as bytes (UTF-8 and UTF-16, as Chromium keeps
  strings in both), in the sandbox's memory (a full checkpoint image on the node), its disk (the btrfs
  subvolume, every file), and Chromium's profile; a positive control shows each search finds what is
  there (the placeholders, a marker, values planted in a host file).
- A form of ANOTHER origin (`other.test`, a second site) submitted with the credential's placeholders
  carries only the placeholders; the page fill refuses a page or form of another origin, and fills
  hostile field names exactly (they reach the page as JSON data, never as code).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import pathlib
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from space.core.errors import Conflict
from space.node.helper.netaddr import node_tag
from space.sdk import Sandbox, Space
from tests.support.egress_net import (
    Upstream,
    UpstreamCA,
    cluster_egress_config,
    leftovers,
    remove_cgroup_parent,
    start_upstream,
)
from tests.support.host import network_traces, runtime_id
from tests.support.mcp_clients import over_http

pytestmark = pytest.mark.root

USERNAME = "alice-" + secrets.token_hex(8)
PASSWORD = "pw-" + secrets.token_hex(12)
ODD_USERNAME = "odd-" + secrets.token_hex(8)
ODD_PASSWORD = "odd-pw-" + secrets.token_hex(12)
OTHER_PASSWORD = "other-pw-" + secrets.token_hex(12)
# Field names that would break out of a string built into JavaScript, CSS or HTML (the credential's
# field-name rule allows them: they are legal HTML input names).
ODD_USER_FIELD = "u')])||alert(1)//<b>"
ODD_PASS_FIELD = "p`${alert(2)}`</script>'"
SECRETS = [USERNAME, PASSWORD, ODD_USERNAME, ODD_PASSWORD, OTHER_PASSWORD]
MARKER = "memory-marker-" + secrets.token_hex(8)


def variants(text: str) -> list[bytes]:
    """How a string can sit in a process's memory or a file: UTF-8 (Latin-1) and UTF-16 (V8, Blink)."""
    return [text.encode(), text.encode("utf-16-le")]


def scan(paths: list[pathlib.Path], needles: list[str]) -> dict[str, list[str]]:
    """{needle: [file, ...]} of every regular file under `paths` holding a variant of the needle."""
    found: dict[str, list[str]] = {}
    wanted = [(needle, form) for needle in needles for form in variants(needle)]
    for root in paths:
        files = (
            [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        )
        for path in files:
            try:
                with (
                    path.open("rb") as handle,
                    mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data,
                ):
                    for needle, form in wanted:
                        if data.find(form) != -1 and str(path) not in found.get(needle, []):
                            found.setdefault(needle, []).append(str(path))
            except (ValueError, OSError):  # empty files cannot be mapped; sockets, vanished files
                continue
    return found


@dataclass
class LoginCluster:
    local: Any  # space.controlplane.local.LocalCluster
    site: Upstream
    other: Upstream
    workdir: pathlib.Path

    def sdk(self) -> Space:
        return Space(
            url=self.local.url, api_key=self.local.api_key, transport=httpx.HTTPTransport(verify=False)
        )

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.local.url, headers={"Authorization": f"Bearer {self.local.api_key}"}, timeout=120
        )


@pytest.fixture(scope="module")
def login_cluster() -> Iterator[LoginCluster]:
    from space.controlplane.local import LocalCluster, free_port

    tag = f"spl{os.getpid() % 100000:05d}"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="space-login-e2e-", dir="/var/tmp"))
    data_dir = pathlib.Path(tempfile.mkdtemp(prefix="space-test-login-", dir="/var/tmp")).resolve()
    test_ca = UpstreamCA(workdir)
    accounts = workdir / "accounts.json"
    accounts.write_text(json.dumps([[USERNAME, PASSWORD], [ODD_USERNAME, ODD_PASSWORD]]))
    upstreams: list[Upstream] = []
    local = LocalCluster(data_dir=data_dir, port=free_port(), network="sandbox", cgroup_parent="space-lgn")
    started = False
    try:
        for name, subnet in (("site", 57), ("other", 58)):
            cert = test_ca.issue(f"{name}.pem", [f"{'login' if name == 'site' else 'other'}.test"], [])
            upstreams.append(start_upstream(tag, name, subnet, cert, workdir, accounts=accounts))
        site, other = upstreams
        hosts = {"login.test": [site.addr], "other.test": [other.addr]}
        local.egress_config = cluster_egress_config(data_dir, hosts, test_ca.ca_file)
        local.start()
        started = True
        yield LoginCluster(local, site, other, workdir)
    finally:
        try:
            if started:
                local.stop(purge=True)
            else:
                with contextlib.suppress(Exception):
                    local.stop(purge=True)
                shutil.rmtree(data_dir, ignore_errors=True)
        finally:  # the upstreams and the cgroup parent go also when the cluster's stop fails
            remove_cgroup_parent("space-lgn")
            for upstream in upstreams:
                upstream.close()
            shutil.rmtree(workdir, ignore_errors=True)
    assert network_traces(node_tag(data_dir)) == [], "network namespaces, links or the nft table left behind"
    assert leftovers(tag) == [], "upstream namespaces left behind"


def login_credential(
    client: httpx.Client, name: str, origin: str, user: str, password: str, **form: Any
) -> None:
    fields = {"username_field": "user", "password_field": "pass", "form_action": "/session"} | form
    made = client.put(
        f"/v1/credentials/{name}",
        json={
            "method": "login",
            "login": {"origin": origin, **fields},
            "username": user,
            "password": password,
        },
    )
    assert made.status_code == 200, made.text


def posted(upstream: Upstream) -> list[dict[str, list[str]]]:
    """The form bodies the site received at /session (logged on the host, outside the sandbox)."""
    return [
        parse_qs(str(e["body"]), keep_blank_values=True)
        for e in upstream.requests()
        if e["method"] == "POST" and str(e["path"]).startswith("/session")
    ]


async def mcp_login(cl: LoginCluster, sandbox_id: str, credential: str) -> str:
    async with over_http(cl.local.url, cl.local.api_key) as mcp:
        return await mcp.ok("browser_login", {"id": sandbox_id, "credential": credential})


def target_of(page: Page) -> str:
    session = page.context.new_cdp_session(page)
    try:
        return str(session.send("Target.getTargetInfo")["targetInfo"]["targetId"])
    finally:
        session.detach()


def test_the_browser_logs_in_and_the_password_never_enters_the_sandbox(login_cluster: LoginCluster) -> None:
    cl = login_cluster
    admin = cl.http()
    login_credential(admin, "site", "https://login.test", USERNAME, PASSWORD)
    login_credential(admin, "other-site", "https://other.test", "other-user", OTHER_PASSWORD)
    login_credential(
        admin, "odd", "https://login.test", ODD_USERNAME, ODD_PASSWORD,
        username_field=ODD_USER_FIELD, password_field=ODD_PASS_FIELD,
    )  # fmt: skip
    sp = cl.sdk()
    sb = sp.sandboxes.create(
        template="browser", limits={"cpus": 1, "memory_mb": 1024},
        allow=["login.test", "other.test"], credentials=["site", "other-site", "odd"],
    )  # fmt: skip
    try:
        placeholders = sb.login_placeholders("site")["fields"]
        with sync_playwright() as pw:
            browser = pw.chromium.connect_over_cdp(sb.browser.cdp_url(), headers=sb.browser.cdp_headers())
            page = browser.contexts[0].new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.goto("https://login.test/login")  # TLS from the gateway: Chromium trusts the node's CA
            assert page.title() == "Sign in"

            # The login: SPACE fills the form with placeholders, the gateway writes the values.
            done = sb.browser.login("site")
            assert done["navigated"] is True and done["title"] == "Signed in", done
            assert done["url"] == "https://login.test/session" and done["target_id"] == target_of(page)
            assert page.inner_text("h1") == "Welcome back"
            assert posted(cl.site)[-1] == {"user": [USERNAME], "pass": [PASSWORD]}

            # Hostile field names reach the page as data: the inputs named so are filled, nothing runs.
            page.goto(f"https://login.test/login?user={quote(ODD_USER_FIELD)}&pass={quote(ODD_PASS_FIELD)}")
            # (through the MCP tool this time, the same call as the SDK's; in a thread of its own, as
            # Playwright's sync API keeps an event loop in this one)
            with ThreadPoolExecutor(1) as pool:
                text = pool.submit(asyncio.run, mcp_login(cl, sb.id, "odd")).result(timeout=300)
            assert "and the page loaded" in text and "'Signed in'" in text, text
            assert posted(cl.site)[-1] == {ODD_USER_FIELD: [ODD_USERNAME], ODD_PASS_FIELD: [ODD_PASSWORD]}
            assert dialogs == []

            # Never into another origin: a form of the origin that posts elsewhere, a page elsewhere.
            other_posts = len(posted(cl.other))
            page.goto("https://login.test/login?action=https://other.test/session")
            with pytest.raises(Conflict, match=re.escape("submits to 'https://other.test'")):
                sb.browser.login("site")
            page.goto("https://other.test/login")
            with pytest.raises(Conflict, match=re.escape("no page of the browser is on https://login.test")):
                sb.browser.login("site")
            with pytest.raises(Conflict, match="not on the credential's origin"):
                sb.browser.login("site", target_id=target_of(page))
            assert len(posted(cl.other)) == other_posts  # nothing was submitted anywhere
            # Typed there by hand, the placeholders reach the other site as they are.
            page.fill("input[name=user]", placeholders["user"])
            page.fill("input[name=pass]", placeholders["pass"])
            with page.expect_navigation():
                page.click("button")
            assert page.title() == "Sign-in failed"
            assert posted(cl.other)[-1] == {"user": [placeholders["user"]], "pass": [placeholders["pass"]]}
            page.evaluate(f"window.keep = ['{MARKER}'].join('')")  # a string only in the page's memory
            # Scanned while the page is open (its renderer's memory is in the checkpoint).
            scan_the_sandbox(cl, sb, placeholders)
            with contextlib.suppress(Exception):
                browser.close()

        def actions() -> set[tuple[str, str]]:
            entries = admin.get("/v1/credentials/site/audit").json()["entries"]
            return {(e["action"], e["host"]) for e in entries if e.get("sandbox_id") == sb.id}

        fills = {("login_filled", "login.test"), ("login_fill_refused", "login.test")}
        assert fills <= actions(), actions()
        # The gateway's report of the values written for login.test (a body to another origin is not
        # read for placeholders at all, ADR 0063: other.test's only shows they were forwarded as typed).
        gateway = {("injected", "login.test")}
        deadline = time.monotonic() + 60  # the node reports its audit in batches
        while not gateway <= (seen := actions()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gateway <= seen, seen
    finally:
        sb.delete(wait=True)  # torn down before the cluster stops (a delete answers before its teardown)
        sp.close()
        admin.close()


def scan_the_sandbox(cl: LoginCluster, sb: Sandbox, placeholders: dict[str, str]) -> None:
    data_dir = pathlib.Path(cl.local.data_dir)
    # The scanner finds what is there: values planted in a host file (UTF-8 and UTF-16).
    planted = cl.workdir / "planted"
    planted.write_bytes(b"\0" * 4096 + PASSWORD.encode() + b"\0" + USERNAME.encode("utf-16-le"))
    assert set(scan([planted], [PASSWORD, USERNAME])) == {PASSWORD, USERNAME}

    # Chromium's profile (cookies, form data, caches), read from inside as one archive.
    profile = sb.exec(["tar", "-C", "/tmp", "-cf", "-", "space-browser"], timeout=120)
    assert profile.exit_code in (0, 1), profile.stderr_bytes  # 1: a file changed while read (it runs)
    archive = cl.workdir / "profile.tar"
    archive.write_bytes(profile.stdout_bytes)
    assert b"login.test" in profile.stdout_bytes and len(profile.stdout_bytes) > 100_000  # the real profile
    assert scan([archive], SECRETS) == {}

    # The disk: every file of the sandbox's btrfs subvolume (a placeholder written there is found).
    sb.files.write("/home/user/typed.txt", placeholders["pass"].encode())
    sb.exec("sync")
    runtime = runtime_id(data_dir, sb.id)
    disk = data_dir / "fs" / "sandboxes" / runtime
    assert placeholders["pass"] in scan([disk], [placeholders["pass"]])
    assert scan([disk], SECRETS) == {}

    # The memory: a full checkpoint image (it holds the page's marker and the placeholders typed).
    snap = sb.snapshots.create(full=True)
    image = data_dir / "fs" / "checkpoints" / runtime / snap.id
    in_image = scan([image], [MARKER, placeholders["user"], placeholders["pass"]])
    assert MARKER in in_image, "control: the page's memory is not in the checkpoint image"
    assert placeholders["pass"] in in_image and placeholders["user"] in in_image, in_image
    assert scan([image, data_dir / "fs" / "snapshots" / runtime], SECRETS) == {}
    # What went where: the values only in the site's own log (on the host, outside the sandbox).
    assert subprocess.run(["grep", "-rqF", PASSWORD, str(cl.site.log)], check=False).returncode == 0
