"""Metadata, list pages (filters, order, tokens) and deadlines in the store, on SQLite and on PostgreSQL
(docs/adr/0048-metadata-lists-and-deadlines.md). The PostgreSQL cases carry the `root` mark."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from space.controlplane.store import Store
from space.controlplane.store.sandbox_listing import SandboxQuery
from space.core.errors import InvalidArgument, InvalidState, NotFound
from space.core.lifecycle import Event, State
from space.core.sandbox_options import MAX_TIMEOUT_S, metadata_filters
from tests.support.clock import FakeClock


def _projects(store: Store) -> tuple[str, str]:
    org = store.create_org("acme")
    return store.create_project(org.id, "mine").id, store.create_project(org.id, "theirs").id


def _ids(page: Any) -> list[str]:
    return [sb.id for sb in page.sandboxes]


# ---- metadata ----------------------------------------------------------------------------------------


def test_metadata_round_trips_and_a_fork_inherits_it(store: Store) -> None:
    mine, _ = _projects(store)
    labels = {"team": "ml", "app.example.test/name": "a=b&c", "unicode": "žluťoučký 🐍", "empty": ""}
    sb = store.create_sandbox(mine, "python", metadata=labels, on_timeout="pause", ttl_s=60)
    assert store.get_sandbox(mine, sb.id).metadata == labels  # type: ignore[union-attr]
    assert sb.on_timeout == "pause"
    child = store.create_sandbox(mine, "python", forked_from=sb.id)
    assert (child.metadata, child.on_timeout) == (labels, "pause")
    own = store.create_sandbox(mine, "python", forked_from=sb.id, metadata={"x": "1"}, on_timeout="delete")
    assert (own.metadata, own.on_timeout) == ({"x": "1"}, "delete")
    assert store.create_sandbox(mine, "python").metadata == {}


OUT_OF_BOUNDS: list[Any] = [
    {f"k{i}": "v" for i in range(65)},  # too many keys
    {"k" * 129: "v"},  # key too long
    {"": "v"},  # empty key
    {"v": "x" * 1025},  # value too long
    {f"k{i}": "x" * 1000 for i in range(17)},  # more than 16 KiB in all
    {"a'; DROP TABLE sandboxes; --": "v"},  # SQL
    {'a"b': "v"},  # would close the quoted JSON path
    {"$.team": "v"},  # a JSON path of its own
    {"a[0]": "v"},
    {"a b": "v"},
    {"a\\b": "v"},
    {"k": 1},  # not a string
    ["k", "v"],  # not a map
]


def test_metadata_out_of_bounds_is_refused_naming_the_field(store: Store) -> None:
    mine, _ = _projects(store)
    for metadata in OUT_OF_BOUNDS:
        with pytest.raises(InvalidArgument) as caught:
            store.create_sandbox(mine, "python", metadata=metadata)
        assert caught.value.details["field"] == "metadata", metadata
    assert store.list_sandboxes(mine) == []
    at_the_bounds = {f"k{i:02}" + "k" * 125: "v" * 128 for i in range(64)}  # 64 keys, 16 KiB exactly
    assert sum(len(k) + len(v) for k, v in at_the_bounds.items()) == 16 * 1024
    assert store.create_sandbox(mine, "python", metadata=at_the_bounds).metadata == at_the_bounds


# ---- lists -------------------------------------------------------------------------------------------


def test_filters_match_in_sql_and_never_cross_projects(store: Store, clock: FakeClock) -> None:
    mine, theirs = _projects(store)
    prod = store.create_sandbox(mine, "python", metadata={"env": "prod", "team": "ml", "q": "a=b&c=%20"})
    clock.advance(1)
    dev = store.create_sandbox(mine, "python", metadata={"env": "dev", "team": "ml"})
    clock.advance(1)
    node = store.create_sandbox(mine, "node", metadata={"env": "prod"})
    foreign = store.create_sandbox(theirs, "python", metadata={"env": "prod", "team": "ml", "q": "a=b&c=%20"})
    store.transition(dev.id, State.PENDING, 0, Event.CREATE)

    def ids(**query: Any) -> set[str]:
        return set(_ids(store.page_sandboxes(mine, SandboxQuery(**query))))

    assert ids() == {prod.id, dev.id, node.id}
    assert ids(metadata={"env": "prod"}) == {prod.id, node.id}
    assert ids(metadata={"env": "prod", "team": "ml"}) == {prod.id}  # all must match
    assert ids(metadata={"q": "a=b&c=%20"}) == {prod.id}  # matched as given, never decoded again
    assert ids(metadata={"team": "ML"}) == set()
    assert ids(metadata={"env": ""}) == set()  # a missing key is not an empty value
    assert ids(template="node") == {node.id}
    assert ids(template="ruby") == set()
    assert ids(states=(State.CREATING,)) == {dev.id}
    assert ids(states=(State.PENDING, State.CREATING)) == {prod.id, dev.id, node.id}
    assert set(_ids(store.page_sandboxes(theirs, SandboxQuery(metadata={"team": "ml"})))) == {foreign.id}
    # Filter keys obey the key rules: SQL or JSON-path syntax is refused, not matched.
    for bad in ("$.env", 'env"', "env') OR 1=1 --", "*"):
        with pytest.raises(InvalidArgument):
            store.page_sandboxes(mine, SandboxQuery(metadata={bad: "prod"}))
    assert ids(template="../x' OR '1'='1") == set()  # no template name: matches nothing, refuses nothing
    with pytest.raises(InvalidArgument):
        store.page_sandboxes(mine, SandboxQuery(template="x" * 65))
    with pytest.raises(InvalidArgument):
        store.page_sandboxes(mine, SandboxQuery(states=("sleeping",)))  # type: ignore[arg-type]


def test_deleted_sandboxes_are_listed_only_when_asked_for(store: Store) -> None:
    mine, _ = _projects(store)
    gone = store.create_sandbox(mine, "python")
    kept = store.create_sandbox(mine, "python")
    store.transition(gone.id, State.PENDING, 0, Event.DELETE)
    store.transition(gone.id, State.DELETING, 1, Event.DELETED)
    assert _ids(store.page_sandboxes(mine, SandboxQuery())) == [kept.id]
    assert _ids(store.page_sandboxes(mine, SandboxQuery(states=(State.DELETED,)))) == [gone.id]


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_pages_follow_creation_order_without_repeats_or_gaps(
    store: Store, clock: FakeClock, order: str
) -> None:
    mine, theirs = _projects(store)
    made = []
    for i in range(11):
        if i % 3 == 0:
            clock.advance(0.000001)  # groups of three share one creation time: ties broken by id
        made.append(store.create_sandbox(mine, "python", metadata={"n": str(i)}))
        store.create_sandbox(theirs, "python")
    expected = [sb.id for sb in sorted(made, key=lambda sb: (sb.created_at, sb.id), reverse=order == "desc")]
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        page = store.page_sandboxes(mine, SandboxQuery(order=order, limit=4, page_token=token))  # type: ignore[arg-type]
        seen += _ids(page)
        pages += 1
        token = page.next_page_token
        if token is None:
            break
    assert seen == expected
    assert pages == 3
    exact = store.page_sandboxes(mine, SandboxQuery(limit=11))
    assert len(exact.sandboxes) == 11 and exact.next_page_token is None  # no token when nothing follows


def test_limits_are_bounded(store: Store) -> None:
    mine, _ = _projects(store)
    for limit in (0, -1, 1001, True):
        with pytest.raises(InvalidArgument) as caught:
            store.page_sandboxes(mine, SandboxQuery(limit=limit))
        assert caught.value.details["field"] == "limit"
    with pytest.raises(InvalidArgument):
        store.page_sandboxes(mine, SandboxQuery(order="sideways"))  # type: ignore[arg-type]


def _forge(payload: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


def test_page_tokens_are_bound_to_project_filters_and_order(store: Store, clock: FakeClock) -> None:
    mine, theirs = _projects(store)
    for _ in range(3):
        clock.advance(1)
        store.create_sandbox(mine, "python", metadata={"env": "prod"})
        store.create_sandbox(theirs, "python", metadata={"env": "prod"})
    query = SandboxQuery(metadata={"env": "prod"}, limit=1)
    token = store.page_sandboxes(mine, query).next_page_token
    assert token is not None
    assert (
        len(
            store.page_sandboxes(
                mine, SandboxQuery(metadata={"env": "prod"}, limit=2, page_token=token)
            ).sandboxes
        )
        == 2
    )
    refused = [
        (theirs, query),  # another project's listing
        (mine, SandboxQuery(metadata={"env": "dev"}, limit=1)),  # other filters
        (mine, SandboxQuery(limit=1)),
        (mine, SandboxQuery(metadata={"env": "prod"}, order="asc", limit=1)),  # other order
        (mine, SandboxQuery(metadata={"env": "prod"}, template="python", limit=1)),
    ]
    for project, other in refused:
        with pytest.raises(InvalidArgument) as caught:
            store.page_sandboxes(project, SandboxQuery(**{**_fields(other), "page_token": token}))
        assert caught.value.details["field"] == "page_token"


def _fields(query: SandboxQuery) -> dict[str, Any]:
    return {name: getattr(query, name) for name in ("states", "template", "metadata", "order", "limit")}


def test_forged_page_tokens_are_refused(store: Store) -> None:
    mine, _ = _projects(store)
    store.create_sandbox(mine, "python")
    store.create_sandbox(mine, "python")
    real = store.page_sandboxes(mine, SandboxQuery(limit=1)).next_page_token
    assert real is not None
    payload = json.loads(base64.urlsafe_b64decode(real + "=" * (-len(real) % 4)))
    forged = [
        "",
        "x" * 600,
        "not base64 !!",
        _forge([1, 2]),
        _forge({**payload, "id": "sb-x' OR '1'='1"}),  # an injection in the position: not a sandbox id
        _forge({**payload, "at": "2030-01-01' OR 1=1 --"}),
        _forge({**payload, "at": "2030-01-01T00:00:00"}),  # naive time
        _forge({**payload, "at": 12}),
        _forge({**payload, "f": "0" * 32}),  # fingerprint of nothing
        _forge({**payload, "v": 2}),
        _forge({**payload, "extra": 1}),
    ]
    for token in forged:
        with pytest.raises(InvalidArgument) as caught:
            store.page_sandboxes(mine, SandboxQuery(limit=1, page_token=token))
        assert caught.value.details["field"] == "page_token", token


def test_metadata_filter_parameters() -> None:
    assert metadata_filters(["a=b", "c=d=e", "f="]) == {"a": "b", "c": "d=e", "f": ""}
    for bad in (["novalue"], ["=v"], ["a=1", "a=2"], ["$x=1"], [f"k{i}=v" for i in range(65)]):
        with pytest.raises(InvalidArgument):
            metadata_filters(bad)


# ---- deadlines ---------------------------------------------------------------------------------------


def test_set_deadline_resets_shortens_and_extends_only_when_asked(store: Store, clock: FakeClock) -> None:
    mine, _ = _projects(store)
    sb = store.create_sandbox(mine, "python", ttl_s=300)
    start = clock()
    assert sb.expires_at == start + timedelta(seconds=300)
    shorter = store.set_deadline(sb.id, 10)
    assert (shorter.expires_at, shorter.ttl_s) == (start + timedelta(seconds=10), 10)  # may shorten
    same = store.set_deadline(sb.id, 5, extend_only=True)
    assert (same.expires_at, same.ttl_s) == (
        shorter.expires_at,
        10,
    )  # never shortened: left exactly as it was
    clock.advance(2)
    later = store.set_deadline(sb.id, 60, extend_only=True)
    assert (later.expires_at, later.ttl_s) == (clock() + timedelta(seconds=60), 60)
    now = store.set_deadline(sb.id, 0)
    assert (now.expires_at, now.ttl_s) == (clock(), 60)  # 0: now; the timeout for later resumes is kept
    endless = store.create_sandbox(mine, "python")
    assert store.set_deadline(endless.id, 30, extend_only=True).expires_at is None  # none is later than any
    assert store.set_deadline(endless.id, 30).expires_at == clock() + timedelta(seconds=30)


def test_set_deadline_refusals(store: Store) -> None:
    mine, _ = _projects(store)
    sb = store.create_sandbox(mine, "python")
    for bad in (-1, MAX_TIMEOUT_S + 1, 10**30, True, 1.5, "5"):
        with pytest.raises(InvalidArgument):
            store.set_deadline(sb.id, bad)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        store.set_deadline("sb-" + "a" * 26, 5)
    store.set_desired(sb.id, State.DELETED)
    with pytest.raises(InvalidState):
        store.set_deadline(sb.id, 5)  # being deleted
    store.transition(sb.id, State.PENDING, 0, Event.DELETE)
    store.transition(sb.id, State.DELETING, 1, Event.DELETED)
    with pytest.raises(InvalidState) as caught:
        store.set_deadline(sb.id, 5)
    assert caught.value.state == "deleted"
    with pytest.raises(InvalidArgument):
        store.create_sandbox(mine, "python", ttl_s=MAX_TIMEOUT_S + 1)


def _running(store: Store, project: str, **kwargs: Any) -> Any:
    sb = store.create_sandbox(project, "python", **kwargs)
    sb = store.transition(sb.id, State.PENDING, 0, Event.CREATE)
    return store.transition(sb.id, State.CREATING, 1, Event.CREATED)


def test_expiry_applies_only_while_the_deadline_is_passed(store: Store, clock: FakeClock) -> None:
    mine, _ = _projects(store)
    sb = _running(store, mine, ttl_s=10, on_timeout="pause")
    assert store.expire_sandbox(sb.id, State.SUSPENDED, clear_deadline=True) is None  # not passed yet
    clock.advance(11)
    assert [s.id for s in store.claim_work("a", 10, 5)] == [sb.id]  # a passed deadline is work
    store.release(sb.id, "a")
    store.set_deadline(sb.id, 60)  # moved meanwhile: an expiry decided on the older read loses
    assert store.expire_sandbox(sb.id, State.SUSPENDED, clear_deadline=True) is None
    clock.advance(61)
    kept = store.expire_sandbox(sb.id, State.SUSPENDED, clear_deadline=True)
    assert kept is not None
    assert (kept.desired_state, kept.expires_at, kept.state) == (State.SUSPENDED, None, State.RUNNING)
    assert [e.kind for e in store.list_events(sb.id)][-1] == "sandbox.expired"
    doomed = _running(store, mine, ttl_s=5)
    clock.advance(6)
    gone = store.expire_sandbox(doomed.id, State.DELETED, clear_deadline=False)
    assert gone is not None and gone.desired_state == State.DELETED
    assert store.expire_sandbox(doomed.id, State.DELETED, clear_deadline=False) is None  # once


def test_coming_back_gives_a_fresh_deadline_never_a_shorter_one(store: Store, clock: FakeClock) -> None:
    mine, _ = _projects(store)
    sb = _running(store, mine, ttl_s=100, on_timeout="pause")
    clock.advance(101)
    sb = store.expire_sandbox(sb.id, State.PAUSED, clear_deadline=True)
    assert sb is not None and sb.expires_at is None
    sb = store.transition(sb.id, State.RUNNING, sb.generation, Event.PAUSE)
    sb = store.transition(sb.id, State.PAUSING, sb.generation, Event.PAUSED)
    assert sb.expires_at is None  # kept: no deadline while it waits
    clock.advance(1000)
    sb = store.transition(sb.id, State.PAUSED, sb.generation, Event.RESUME)
    sb = store.transition(sb.id, State.RESUMING, sb.generation, Event.RESUMED)
    assert sb.expires_at == clock() + timedelta(seconds=100)
    assert store.load_sandbox(sb.id).expires_at == sb.expires_at  # type: ignore[union-attr]
    store.set_deadline(sb.id, 1000)  # its timeout for later resumes too
    clock.advance(30)
    sb = store.transition(sb.id, State.RUNNING, sb.generation, Event.PAUSE)
    sb = store.transition(sb.id, State.PAUSING, sb.generation, Event.PAUSED)
    sb = store.transition(sb.id, State.PAUSED, sb.generation, Event.RESUME)
    sb = store.transition(sb.id, State.RESUMING, sb.generation, Event.RESUMED)
    assert sb.expires_at == clock() + timedelta(seconds=1000)
    sb = store.transition(sb.id, State.RUNNING, sb.generation, Event.STOP)
    sb = store.transition(sb.id, State.STOPPING, sb.generation, Event.STOPPED)
    clock.advance(5000)  # stopped past its deadline (kept: it was acted on); started again: a fresh one
    sb = store.transition(sb.id, State.STOPPED, sb.generation, Event.START)
    assert store.transition(
        sb.id, State.STARTING, sb.generation, Event.STARTED
    ).expires_at == clock() + timedelta(seconds=1000)
    endless = _running(store, mine)
    endless = store.transition(endless.id, State.RUNNING, endless.generation, Event.PAUSE)
    endless = store.transition(endless.id, State.PAUSING, endless.generation, Event.PAUSED)
    endless = store.transition(endless.id, State.PAUSED, endless.generation, Event.RESUME)
    assert store.transition(endless.id, State.RESUMING, endless.generation, Event.RESUMED).expires_at is None


def test_created_after_is_inclusive_to_the_microsecond(store: Store, clock: FakeClock) -> None:
    mine, theirs = _projects(store)
    early = store.create_sandbox(mine, "python")
    clock.advance(0.000001)
    late = store.create_sandbox(mine, "python")
    store.create_sandbox(theirs, "python")

    def after(at: datetime) -> list[str]:
        return _ids(store.page_sandboxes(mine, SandboxQuery(created_after=at, order="asc")))

    assert after(early.created_at) == [early.id, late.id]  # its own creation time includes it
    assert after(early.created_at + timedelta(microseconds=1)) == [late.id]
    assert after(late.created_at.astimezone(timezone(timedelta(hours=-5)))) == [late.id]  # any offset
    assert after(late.created_at + timedelta(seconds=1)) == []
    with pytest.raises(InvalidArgument) as caught:
        store.page_sandboxes(mine, SandboxQuery(created_after=datetime(2030, 1, 1)))  # naive on purpose
    assert caught.value.details["field"] == "created_after"
    token = store.page_sandboxes(mine, SandboxQuery(created_after=early.created_at, limit=1)).next_page_token
    assert token is not None
    with pytest.raises(InvalidArgument):  # a token is bound to its created_after too
        store.page_sandboxes(mine, SandboxQuery(created_after=late.created_at, limit=1, page_token=token))
