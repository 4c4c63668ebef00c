"""The web console end to end (ADR 0061): Debian's chromium, driven by Playwright, against a real installation
(`real_cluster`: the control plane, node agent and root helper `space up` runs, runsc sandboxes).

A member signs in (a bad key first: it stays on the sign-in page), creates a sandbox, types in its terminal
and sees the output, uploads a file and sees it listed, takes a snapshot, forks, sees the fork as a branch of
the tree, rolls back to the first snapshot by keyboard (a file written since is gone) and sees the rollback in
the tree with the next snapshot hanging off it as a new branch, also in a 360 px window (nothing overflows),
and deletes with a confirmation (a cancelled one deletes nothing). A read-only key sees the sandboxes with
every action disabled (rollbacks too), and the API refuses the action when asked anyway; it sees a
credential's usage on the credentials page (the uses its node reported, never the value). No page logs an
error (a CSP violation would). A screenshot of each page goes to tests/artifacts/console/ (gitignored).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

from space.node.agent.identity import default_identity_file
from tests.support import cluster as c

pytestmark = pytest.mark.root
real_cluster = c.real_cluster
ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts" / "console"
CHROMIUM = "/usr/bin/chromium"  # Debian's package (scripts/setup.sh); browser downloads are not used
WAIT_MS = 60_000
CREDENTIAL = "console-token"
SECRET = "console-secret-value-4242"


@dataclass
class Tenant:
    url: str
    project: str
    member: str
    reader: str
    admin: str
    data_dir: pathlib.Path

    def http(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


@pytest.fixture(scope="module")
def tenant(real_cluster: c.RealCluster) -> Iterator[Tenant]:
    """A fresh project with a member and a read-only key; its sandboxes are deleted at the end."""
    name = f"console-{secrets.token_hex(3)}"
    with httpx.Client(
        base_url=real_cluster.url, headers={"Authorization": f"Bearer {real_cluster.api_key}"}, timeout=60
    ) as admin:
        assert admin.post("/v1/projects", json={"name": name}).status_code == 201
        keys = {
            role: admin.post("/v1/keys", json={"project": name, "role": role}).json()["key"]
            for role in ("member", "read-only")
        }
        made = admin.put(
            f"/v1/credentials/{CREDENTIAL}",
            json={"value": SECRET, "hosts": ["api.example.com"], "scope": "project", "project": name},
        )
        assert made.status_code == 200, made.text
    tenant = Tenant(
        real_cluster.url, name, keys["member"], keys["read-only"], real_cluster.api_key, real_cluster.data_dir
    )
    try:
        yield tenant
    finally:
        with tenant.http(tenant.member) as member:
            for sb in member.get("/v1/sandboxes").json()["sandboxes"]:
                member.delete(f"/v1/sandboxes/{sb['id']}")
            c.wait_for(
                lambda: member.get("/v1/sandboxes").json()["sandboxes"] == [],
                timeout=60,
                what="the console's sandboxes deleted",
            )
        with tenant.http(tenant.admin) as admin:
            params = {"scope": "project", "project": name}
            assert admin.delete(f"/v1/credentials/{CREDENTIAL}", params=params).status_code == 200


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        # As root, chromium needs --no-sandbox (its own sandbox, not SPACE's).
        launched = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


@contextlib.contextmanager
def console_page(browser: Browser, tenant: Tenant, *, width: int = 1280) -> Iterator[tuple[Page, list[str]]]:
    """A fresh browser context (its own sessionStorage) on the console; the errors its pages log."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    problems: list[str] = []

    def logged(message: ConsoleMessage) -> None:
        if message.type == "error":
            problems.append(message.text)

    page.on("console", logged)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.goto(f"{tenant.url}/console/")
    try:
        yield page, problems
    except Exception as exc:
        exc.add_note(f"the page logged: {problems or 'no errors'}")  # e.g. a module that failed to load
        raise
    finally:
        context.close()


def sign_in(page: Page, key: str) -> None:
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def only_expected(problems: list[str]) -> list[str]:
    # A refused request is logged by the browser itself ("Failed to load resource: ... 401/403"): the
    # tests provoke those on purpose. Anything else (a script error, a CSP violation) is a failure.
    return [p for p in problems if "Failed to load resource" not in p]


def report_uses(tenant: Tenant, sandbox_id: str, *, injected: int, refused: int) -> None:
    """Report uses of CREDENTIAL in `sandbox_id` as the installation's node does (its identity from its data
    directory): no upstream is reachable from here, so the gateway itself cannot inject for real."""
    identity = json.loads(default_identity_file(tenant.data_dir).read_text())
    events = [
        {"sandbox_id": sandbox_id, "action": "injected", "credential": CREDENTIAL, "host": "api.example.com"}
    ]
    events = events * injected + [{**events[0], "action": "rate_limited"}] * refused
    with httpx.Client(
        base_url=tenant.url, headers={"Authorization": f"Bearer {identity['identity']}"}
    ) as node:
        answer = node.post(f"/v1/nodes/{identity['node_id']}/audit", json={"events": events})
    assert answer.status_code == 200 and answer.json()["accepted"] == len(events), answer.text


def test_a_member_works_with_a_sandbox(browser: Browser, tenant: Tenant) -> None:
    with console_page(browser, tenant) as (page, problems):
        sign_in(page, "space_not_a_key")
        expect(page.locator("#signin-error")).to_contain_text("not accepted")
        expect(page.get_by_label("API key")).to_be_visible()
        assert page.evaluate("sessionStorage.length") == 0 and "space_" not in page.url
        shot(page, "1-sign-in")

        sign_in(page, tenant.member)
        expect(page.get_by_role("heading", name="Sandboxes")).to_be_visible()
        page.get_by_role("button", name="Create sandbox").click()
        page.get_by_label("Template", exact=True).select_option("python")
        page.get_by_label("Metadata (key=value, comma separated)").fill("suite=console")
        page.locator("#create-submit").click()
        row = page.locator("tbody tr[data-id]").first
        expect(row.locator("[data-state]")).to_have_attribute("data-state", "running", timeout=WAIT_MS)
        sandbox_id = row.get_attribute("data-id")
        assert sandbox_id and tenant.member not in page.url
        page.get_by_label("Filter by metadata").fill("suite=nothing")
        expect(page.locator("tbody tr[data-id]")).to_have_count(0)
        page.get_by_label("Filter by metadata").fill("suite=console")
        expect(page.locator("tbody tr[data-id]")).to_have_count(1)
        shot(page, "2-sandboxes")

        page.get_by_role("link", name=sandbox_id).click()
        expect(page.get_by_role("heading", name=sandbox_id)).to_be_visible()
        page.get_by_role("button", name="Open terminal").click()
        expect(page.locator("#terminal-title + .toolbar")).to_contain_text("connected", timeout=WAIT_MS)
        page.keyboard.type("echo hi-$((40 + 2))\n")  # the answer, not the echoed command
        expect(page.locator("#terminal .xterm-rows")).to_contain_text("hi-42", timeout=WAIT_MS)

        page.locator("#files-upload").set_input_files(
            files=[{"name": "hello.txt", "mimeType": "text/plain", "buffer": b"hello from the console\n"}]
        )
        page.get_by_role("button", name="Upload", exact=True).click()
        expect(page.locator('tr[data-name="hello.txt"]')).to_be_visible(timeout=WAIT_MS)
        with tenant.http(tenant.member) as api:
            got = api.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "hello.txt"})
            assert got.content == b"hello from the console\n", got.text

        actions = page.get_by_role("group", name="Actions")
        actions.get_by_role("button", name=f"Snapshot {sandbox_id}").click()
        snapshot = page.locator("#tree li[data-snapshot]").first
        expect(snapshot).to_be_visible(timeout=WAIT_MS)
        actions.get_by_role("button", name=f"Fork {sandbox_id}").click()
        branch = page.locator("#tree li.branch [data-sandbox]").first
        expect(branch).to_be_visible(timeout=WAIT_MS)
        child = branch.get_attribute("data-sandbox")
        assert child and child != sandbox_id
        with tenant.http(tenant.member) as api:
            record = api.get(f"/v1/sandboxes/{child}").json()
        assert record["forked_from"] == sandbox_id
        # The fork hangs under the snapshot it started from, inside its source's branch of the tree.
        fork_point = page.locator(f'#tree li[data-snapshot="{record["fork_snapshot_id"]}"]')
        expect(fork_point.locator(f'[data-sandbox="{child}"]')).to_be_visible()
        shot(page, "3-sandbox")

        # Roll back to the first snapshot (by keyboard); what was written since is gone.
        first = snapshot.get_attribute("data-snapshot")
        with tenant.http(tenant.member) as api:
            wrote = api.put(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "later.txt"}, content=b"x")
            assert wrote.status_code in (200, 201, 204), wrote.text
        roll = page.locator(f'#tree button[data-rollback="{first}"]')
        expect(roll).to_have_accessible_name(f"Roll back {sandbox_id} to {first}")
        roll.focus()
        page.keyboard.press("Enter")
        expect(page.locator("#confirm-title")).to_have_text(f"Roll back {sandbox_id} to {first}?")
        page.locator("#confirm-ok").click()
        rolled = page.locator(f'#tree li[data-snapshot="{first}"] > ul > li.rolled[data-rolled-to="{first}"]')
        expect(rolled).to_be_visible(timeout=WAIT_MS)
        expect(rolled.locator(".node.now")).to_contain_text(f"{sandbox_id} is running")
        expect(page.locator("#tree li.left")).to_contain_text(f"rolled back to {first}")  # the line it left
        with tenant.http(tenant.member) as api:
            assert (
                api.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "later.txt"}).status_code == 404
            )
            assert (
                api.get(f"/v1/sandboxes/{sandbox_id}/files", params={"path": "hello.txt"}).status_code == 200
            )
            events = api.get(f"/v1/sandboxes/{sandbox_id}/events", params={"kind": "sandbox.rolled_back"})
            assert [e["detail"]["snapshot_id"] for e in events.json()["events"]] == [first]
        # The next snapshot continues the new branch; the fork stays where it was.
        expect(actions.get_by_role("button", name=f"Snapshot {sandbox_id}")).to_be_enabled(timeout=WAIT_MS)
        actions.get_by_role("button", name=f"Snapshot {sandbox_id}").click()
        expect(rolled.locator("li[data-snapshot]")).to_have_count(1, timeout=WAIT_MS)
        expect(rolled.locator("li.now")).to_have_count(1)
        expect(page.locator("#tree li.now")).to_have_count(2)  # the sandbox's and its fork's
        expect(fork_point.locator(f'[data-sandbox="{child}"]')).to_be_visible()
        expect(page.locator("#status")).to_be_empty(timeout=10_000)  # the toast would cover the tree
        shot(page, "3b-sandbox-rolled-back")
        page.set_viewport_size({"width": 360, "height": 800})
        expect(rolled).to_be_visible()
        overflow = page.evaluate(
            "() => [...document.querySelectorAll('#tree .node')].filter((n) =>"
            " n.getBoundingClientRect().right > document.documentElement.clientWidth + 1).length"
        )
        assert overflow == 0
        # The terminal refits from a ResizeObserver, a frame or more after the viewport shrank. (Polled from
        # here: wait_for_function evaluates its string with eval, which the console's CSP refuses.)
        deadline = time.monotonic() + 5
        while not page.evaluate("document.documentElement.scrollWidth <= innerWidth"):
            assert time.monotonic() < deadline, "the page stays wider than a 360 px window"
            page.wait_for_timeout(100)
        page.locator("#tree").screenshot(path=str(ARTIFACTS / "3c-tree-narrow.png"))
        page.set_viewport_size({"width": 1280, "height": 900})

        delete = actions.get_by_role("button", name=f"Delete {sandbox_id}")
        delete.focus()  # by keyboard: Enter opens the confirmation, Escape closes it, Cancel by click too
        page.keyboard.press("Enter")
        expect(page.locator("#confirm")).to_be_visible()
        expect(page.locator("#confirm-cancel")).to_be_focused()
        page.keyboard.press("Escape")
        expect(page.locator("#confirm")).to_be_hidden()
        delete.click()
        page.get_by_role("button", name="Cancel").click()
        with tenant.http(tenant.member) as api:
            assert api.get(f"/v1/sandboxes/{sandbox_id}").json()["desired_state"] == "running"
        actions.get_by_role("button", name=f"Delete {sandbox_id}").click()
        page.locator("#confirm-ok").click()
        expect(page.get_by_role("heading", name="Sandboxes")).to_be_visible()
        expect(page.locator(f'tr[data-id="{sandbox_id}"]')).to_have_count(0, timeout=WAIT_MS)

        page.get_by_role("link", name="Credentials").click()
        credentials = page.get_by_role("table", name="Credentials")
        expect(credentials.locator("tbody tr")).to_contain_text(CREDENTIAL)
        expect(credentials).to_contain_text("api.example.com")
        expect(credentials.locator("tbody tr").first).to_contain_text("not used")
        assert SECRET not in page.content()  # names, hosts, expiry: never a value
        shot(page, "5-credentials")
        page.get_by_role("link", name="Nodes").click()
        expect(page.locator("main")).to_contain_text("only an organisation admin key")
        assert only_expected(problems) == [], problems


def test_the_operator_sees_the_nodes(browser: Browser, tenant: Tenant) -> None:
    with console_page(browser, tenant) as (page, problems):
        sign_in(page, tenant.admin)  # the org admin key `space up` made
        page.get_by_role("link", name="Nodes").click()
        table = page.get_by_role("table", name="Nodes")
        expect(table.locator("tbody tr")).to_have_count(1)
        expect(table).to_contain_text("ready")
        shot(page, "4-nodes")
        assert only_expected(problems) == [], problems


def test_a_read_only_key_cannot_act(browser: Browser, tenant: Tenant) -> None:
    with tenant.http(tenant.member) as api:
        made = api.post(
            "/v1/sandboxes",
            json={"template": "python", "metadata": {"suite": "read-only"}, "credentials": [CREDENTIAL]},
        )
        assert made.status_code == 201, made.text
        sandbox_id = made.json()["id"]
    with console_page(browser, tenant, width=420) as (page, problems):  # a narrow window too
        sign_in(page, tenant.reader)
        row = page.locator(f'tr[data-id="{sandbox_id}"]')
        expect(row.locator("[data-state]")).to_have_attribute("data-state", "running", timeout=WAIT_MS)
        expect(page.get_by_role("button", name="Create sandbox")).to_be_disabled()
        buttons = row.locator("button[data-action]")
        expect(buttons).to_have_count(6)
        for index in range(6):
            expect(buttons.nth(index)).to_be_disabled()
        shot(page, "6-read-only-narrow")
        # The disabled button is a courtesy: the API is what refuses.
        answer: dict[str, Any] = page.evaluate(
            """async (id) => {
                const r = await fetch(`/v1/sandboxes/${id}/pause`, {method: "POST",
                  headers: {Authorization: `Bearer ${sessionStorage.getItem("space.console.key")}`}});
                return {status: r.status, body: await r.json()};
            }""",
            sandbox_id,
        )
        assert answer["status"] == 403 and answer["body"]["error"]["code"] == "permission_denied"
        with tenant.http(tenant.member) as api:
            taken = api.post(f"/v1/sandboxes/{sandbox_id}/snapshots", json={"full": False})
            assert taken.status_code == 201, taken.text
        page.get_by_role("link", name=sandbox_id).click()
        expect(page.get_by_role("button", name="Open terminal")).to_be_disabled()
        expect(page.locator(f'#tree button[data-rollback="{taken.json()["id"]}"]')).to_be_disabled()
        expect(page.locator("#files-upload")).to_be_disabled()
        # Its bound credential: named in its egress policy, its use (the node fetching it) in the audit.
        expect(page.locator("#egress")).to_contain_text(CREDENTIAL)
        use = page.get_by_role("table", name="Credential use")
        expect(use.locator("tbody tr").first).to_contain_text(CREDENTIAL, timeout=WAIT_MS)
        assert SECRET not in page.content()
        shot(page, "7-sandbox-read-only-narrow")

        # Its uses as its node's gateway reports them (POST /v1/nodes/{id}/audit with the node's own
        # identity): the credentials page counts them; never the value.
        report_uses(tenant, sandbox_id, injected=3, refused=1)
        page.get_by_role("link", name="Credentials").click()
        credentials = page.get_by_role("table", name="Credentials")
        usage = credentials.locator(f'tbody tr:has-text("{CREDENTIAL}") td[data-label="Usage"]')
        expect(usage).to_contain_text("3 injections")
        expect(usage).to_contain_text("1 refusal")
        assert SECRET not in page.content()
        shot(page, "8-credentials-usage-narrow")
        assert only_expected(problems) == [], problems
    with tenant.http(tenant.member) as api:
        assert api.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == "running"
