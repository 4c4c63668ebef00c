"""The DevTools (CDP) conversation that fills a login form with a `login` credential's placeholders and
submits it (ADR 0066); the egress gateway writes the real values into that origin's submission (ADR 0063).

`fill_login(send, recv, form, placeholders)`: picks the page (the given target, else the first page on the
credential's origin), checks in CDP's own target list and again inside the page that the page is on the
credential's origin, finds the two named inputs of one form, checks that the form POSTs to the origin (to
`form_action` when the credential names one), sets the placeholders as a user's typing would (the input
element's own value setter, then `input` and `change` events), submits the form (its first submit button
as the submitter) and waits for the main frame's navigation and `load`.

Invariants:
- The page's script is one constant function; the field names, origin and placeholders reach it only as
  JSON data (`FILL_SCRIPT(<json>)`, ASCII-escaped), never as text spliced into code.
- Placeholders are never typed into a page or form of another origin: that is refused (409) before any
  input is touched. They are not secret (the sandbox holds them anyway); the refusal keeps a foreign page
  from collecting them and an agent from thinking it logged in.
- The page's DOM is the page's: it may clobber form properties with inputs named `action`, `method` or
  `elements`, so the script reads them through the prototypes' own getters, and the answers it gives are
  parsed as untrusted data (bounded, typed) here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Final

from space.core import errors
from space.core.cdp_conversation import Conversation, Receive, Send

TARGET_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
# The origin of a page URL as Chromium lists it (already normalised: lower-case host, no default port);
# user info, an address in brackets or anything unusual does not match, and such a page is no origin's.
HTTPS_ORIGIN: Final = re.compile(r"https://([a-z0-9.-]+)(?::([0-9]{1,5}))?(?:[/?#]|$)")
MAX_ANSWER_TEXT: Final = 2048

# Runs in the page with one argument, {origin, username_field, password_field, form_action, username,
# password}; answers {outcome, ...}. Every form property is read through HTMLFormElement's / Element's
# prototypes, since a form's inputs shadow its properties by name (DOM clobbering).
FILL_SCRIPT: Final = """(function (a) {
  "use strict";
  if (window.location.origin !== a.origin) return {outcome: "foreign_origin", where: window.location.origin};
  var inputs = Array.prototype.slice.call(Document.prototype.querySelectorAll.call(document, "input"));
  var formOf = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, "form").get;
  var nameOf = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, "name").get;
  var password = inputs.filter(function (i) { return nameOf.call(i) === a.password_field; })[0];
  if (!password) return {outcome: "no_field", where: a.password_field};
  var form = formOf.call(password);
  if (!form) return {outcome: "no_form", where: a.password_field};
  var user = inputs.filter(function (i) {
    return nameOf.call(i) === a.username_field && formOf.call(i) === form;
  })[0];
  if (!user) return {outcome: "no_field", where: a.username_field};
  var attribute = Element.prototype.getAttribute;
  var action = new URL(attribute.call(form, "action") || document.URL, document.baseURI);
  if (action.origin !== a.origin) return {outcome: "foreign_action", where: action.origin};
  if (a.form_action !== null && action.pathname !== a.form_action) {
    return {outcome: "other_action", where: action.pathname};
  }
  var method = (attribute.call(form, "method") || "get").toLowerCase();
  if (method !== "post") return {outcome: "not_post", where: method};
  var setValue = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, "value").set;
  [[user, a.username], [password, a.password]].forEach(function (pair) {
    HTMLElement.prototype.focus.call(pair[0]);
    setValue.call(pair[0], pair[1]);
    pair[0].dispatchEvent(new Event("input", {bubbles: true}));
    pair[0].dispatchEvent(new Event("change", {bubbles: true}));
  });
  var submitter = Element.prototype.querySelector.call(
    form, "button[type=submit], input[type=submit], button:not([type])");
  HTMLFormElement.prototype.requestSubmit.call(form, submitter || undefined);
  return {outcome: "submitted", where: window.location.href};
})"""
# What the page reports after the navigation (its own document: read the same way).
STATE_SCRIPT: Final = "({url: document.URL, title: String(document.title)})"


@dataclass(frozen=True)
class LoginForm:
    """A login credential's form as the gateway matches it (ADR 0063): origin https://host[:port]."""

    origin: str
    username_field: str
    password_field: str
    form_action: str | None


@dataclass(frozen=True)
class LoginFill:
    target_id: str
    navigated: bool
    url: str
    title: str


def check_target_id(target_id: object) -> str | None:
    if target_id is None:
        return None
    if not isinstance(target_id, str) or TARGET_ID_PATTERN.fullmatch(target_id) is None:
        raise errors.InvalidArgument("target_id must be a DevTools target id", field="target_id")
    return target_id


def origin_of(url: str) -> str | None:
    """The https origin of `url` as a credential stores it (`:443` dropped), or None for anything else."""
    match = HTTPS_ORIGIN.match(url)
    if match is None:
        return None
    host, port = match.group(1), match.group(2)
    return f"https://{host}" + (f":{int(port)}" if port is not None and int(port) != 443 else "")


def _text(value: object) -> str:
    return value[:MAX_ANSWER_TEXT] if isinstance(value, str) else ""


def _pick_page(pages: list[dict[str, Any]], form: LoginForm, target_id: str | None) -> str:
    """The page to fill: the given target (a page on the origin), else the first page on the origin."""
    if target_id is not None:
        page = next((p for p in pages if p.get("targetId") == target_id and p.get("type") == "page"), None)
        if page is None:
            raise errors.NotFound(f"the browser has no page {target_id!r}", field="target_id")
        where = origin_of(str(page.get("url", "")))
        if where != form.origin:
            raise errors.Conflict(
                f"page {target_id} is on {_text(where or page.get('url'))!r}, not on the credential's "
                f"origin {form.origin}: its placeholders are typed into that origin's pages only",
                field="target_id",
            )
        return target_id
    on_origin = [
        p for p in pages if p.get("type") == "page" and origin_of(str(p.get("url", ""))) == form.origin
    ]
    if not on_origin:
        raise errors.Conflict(
            f"no page of the browser is on {form.origin} (open its login page first)", field="credential"
        )
    return str(on_origin[0]["targetId"])


#: The fill script's refusals: outcome -> (error, message with {where}, the page's value, and {form}).
REFUSALS: Final[dict[str, tuple[type[errors.SpaceError], str]]] = {
    "foreign_origin": (errors.Conflict, "the page moved to {where!r}, not {form.origin}"),
    "no_field": (errors.NotFound, "the page has no input named {where!r}"),
    "no_form": (errors.NotFound, "the input {where!r} is in no form"),
    "foreign_action": (
        errors.Conflict,
        "the login form submits to {where!r}, not to the credential's origin {form.origin}",
    ),
    "other_action": (
        errors.Conflict,
        "the login form submits to {where!r}, not to the credential's form_action {form.form_action}",
    ),
    "not_post": (
        errors.Conflict,
        "the login form is sent with {where!r}, not POST (the gateway writes into form bodies only)",
    ),
}


def _refusal(answer: dict[str, Any], form: LoginForm) -> errors.SpaceError:
    outcome = answer.get("outcome")
    if not isinstance(outcome, str) or outcome not in REFUSALS:
        return errors.SpaceError(f"browser: the fill script answered {_text(json.dumps(answer))}")
    kind, message = REFUSALS[outcome]
    return kind(
        message.format(where=_text(answer.get("where")), form=form), field="credential", outcome=outcome
    )


async def _evaluate(cdp: Conversation, session: str, expression: str) -> dict[str, Any]:
    result = await cdp.call(
        "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
    )
    if "exceptionDetails" in result:
        details = result["exceptionDetails"]
        text = details.get("text", "") if isinstance(details, dict) else ""
        raise errors.SpaceError(f"browser: the page's script failed: {_text(text)}")
    value = (result.get("result") or {}).get("value")
    if not isinstance(value, dict):
        raise errors.SpaceError("browser: the page's script answered no object")
    return value


def fill_script(form: LoginForm, placeholders: tuple[str, str]) -> str:
    """FILL_SCRIPT applied to its data: the only JavaScript text this module builds."""
    data = {
        "origin": form.origin, "username_field": form.username_field, "password_field": form.password_field,
        "form_action": form.form_action, "username": placeholders[0], "password": placeholders[1],
    }  # fmt: skip
    return f"{FILL_SCRIPT}({json.dumps(data, ensure_ascii=True)})"


async def fill_login(
    send: Send,
    recv: Receive,
    form: LoginForm,
    placeholders: tuple[str, str],
    *,
    target_id: str | None = None,
    navigation: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
) -> LoginFill:
    """Fill and submit (see the module). `placeholders` = (username's, password's). `navigation` makes the
    context (a deadline: this module does no I/O) that bounds the wait for the new page, None: the
    caller's deadline only; without a navigation in time the answer says `navigated: False` and what the
    page is now."""
    cdp = Conversation(send, recv)
    pages = (await cdp.call("Target.getTargets")).get("targetInfos") or []
    target = _pick_page([p for p in pages if isinstance(p, dict)], form, target_id)
    session = (await cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
    await cdp.call("Page.enable", session=session)
    cdp.forget_navigation(session)
    answer = await _evaluate(cdp, session, fill_script(form, placeholders))
    if answer.get("outcome") != "submitted":
        raise _refusal(answer, form)
    navigated = True
    try:
        if navigation is None:
            await cdp.until_navigated(session)
        else:
            async with navigation():
                await cdp.until_navigated(session)
    except TimeoutError:
        navigated = False
    state = await _evaluate(cdp, session, STATE_SCRIPT)
    # No detach: the connection ends with the caller's call, and Chromium drops its sessions with it.
    return LoginFill(target, navigated, _text(state.get("url")), _text(state.get("title")))
