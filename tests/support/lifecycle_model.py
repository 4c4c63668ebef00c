"""The lifecycle model (issue 11): what the API must answer to each lifecycle request, predicted from
space.core.lifecycle's table, and a hypothesis state machine that sends random sequences of requests to a
real control plane and compares every answer with the prediction.

The prediction (`predict_action`, `predict_use`) is the table plus the two rules of the API the docs state:
- a lifecycle action whose target is already the sandbox's wish is a no-op (200, nothing changes), so a
  retried request is harmless; any other action is accepted exactly when the table allows its event in the
  current state, and refused with 409 `invalid_state` naming that state;
- a data-plane use (exec, checkpoint, fork) of a paused or suspended sandbox wakes it first (the table's
  resume or restore); of any other state but running it is a 409 naming the state.

Each request is sent in one of several MODES: once; twice concurrently (a client retrying too early); with
an Idempotency-Key and then replayed with it (the same status and body, one effect: the generation does not
move); twice concurrently with the same key (both get the one answer); and with a key reused for another
request (409 `conflict`, no effect).

After every step the invariants hold: every state the API shows is a state of the table; the observed state
reaches the desired one and nothing stays in an -ing state; generations never go backwards; a deleted
sandbox stays deleted (404, tombstone); every live sandbox is held by exactly one node (the one its record
names) and a suspended one by none.

`LifecycleMachine` is abstract over the installation (`Target`): tests/model/test_lifecycle_model.py runs it
on a control plane over fake-driver node agents, tests/model/test_lifecycle_model_runsc.py on real runsc.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from space.core import lifecycle
from space.core.lifecycle import Event, State

#: Lifecycle routes: action -> (the table's event, the state the route asks for).
ACTIONS: dict[str, tuple[Event, State]] = {
    "pause": (Event.PAUSE, State.PAUSED),
    "resume": (Event.RESUME, State.RUNNING),
    "stop": (Event.STOP, State.STOPPED),
    "start": (Event.START, State.RUNNING),
    "suspend": (Event.SUSPEND, State.SUSPENDED),
    "restore": (Event.RESTORE, State.RUNNING),
    "delete": (Event.DELETE, State.DELETED),
}
KEYED_MODES = ("replay", "concurrent_key", "other_body")
MODES = ("once", "twice", *KEYED_MODES)
SETTLE_TIMEOUT_S = 60.0
#: Steps between two crashes at least (a crash waits for a heartbeat: the slowest step by far).
CRASH_EVERY = 4


def soak() -> bool:
    return os.environ.get("SPACE_SOAK", "") not in ("", "0")


def machine_settings(profile: dict[str, int]) -> settings:
    """Hypothesis settings of a machine run: no deadline (steps wait for real processes), no example
    database, and shrinking only in soak runs: replaying a real cluster's sequences again and again would
    outlast the short run's timeout and hide the failure it found (the unshrunk sequence is printed)."""
    phases = list(Phase) if soak() else [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    return settings(
        **profile,  # type: ignore[arg-type]
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@dataclass(frozen=True)
class Outcome:
    """A predicted answer: accepted (and the stable state it settles in) or refused naming `state`."""

    accepted: bool
    state: State


def predict_action(state: State, action: str) -> Outcome:
    """What a lifecycle route answers for a sandbox settled in `state` (module docstring)."""
    event, target = ACTIONS[action]
    if state == target or lifecycle.can(state, event):
        return Outcome(True, target)
    return Outcome(False, state)


def _wake_event(state: State) -> Event | None:
    """The table's event a data-plane use takes to bring a sandbox in `state` back to running, if any."""
    for event in (Event.RESUME, Event.RESTORE):
        if lifecycle.can(state, event):
            return event
    return None


def predict_use(state: State) -> Outcome:
    """What a data-plane use (exec, checkpoint, fork) answers for a sandbox settled in `state`."""
    if state == State.RUNNING or _wake_event(state) is not None:
        return Outcome(True, State.RUNNING)
    return Outcome(False, state)


@dataclass
class Answer:
    status: int
    body: Any

    @property
    def code(self) -> str | None:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("code"))
        return None

    @property
    def refused_state(self) -> str | None:
        if self.code != "invalid_state":
            return None
        return str(self.body["error"]["details"].get("state"))


@dataclass
class Expected:
    """What the model knows of one live sandbox."""

    state: State
    generation: int
    snapshots: list[str] = field(default_factory=list)  # every snapshot taken (disk and full), oldest first


@dataclass
class Tally:
    """Sequences (examples) and steps run, per machine: the numbers the closing note reports."""

    sequences: int = 0
    steps: int = 0
    requests: int = 0
    refusals: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=dict)
    #: Wall time per rule (from its first request to the invariants) and of the invariants.
    seconds: dict[str, float] = field(default_factory=dict)

    def add_time(self, what: str, seconds: float) -> None:
        self.seconds[what] = round(self.seconds.get(what, 0.0) + seconds, 2)

    def line(self, name: str) -> str:
        return (
            f"{name}: {self.sequences} sequences, {self.steps} steps, {self.requests} requests "
            f"({self.refusals} refused as predicted), modes {dict(sorted(self.modes.items()))}, "
            f"rules {dict(sorted(self.rules.items()))}, seconds {dict(sorted(self.seconds.items()))}"
        )


class Target:
    """The installation under test (a control plane and its nodes), as the machine needs it."""

    url: str
    #: The limits of every sandbox the machine creates.
    limits: dict[str, Any]
    #: The nodes' own views: node id -> {sandbox id -> observed state}.
    holdings: Callable[[], dict[str, dict[str, str]]]

    def project_key(self) -> str:
        """An API key of the project the sequences run in (each sequence deletes what it made)."""
        raise NotImplementedError

    def crash(self, sandbox_id: str, node_id: str) -> None:
        """Kill the sandbox's runtime on its node, as a crash would (the node reports it)."""
        raise NotImplementedError

    def tombstone(self, sandbox_id: str) -> str | None:
        """The state the database keeps for `sandbox_id` (None: no row)."""
        raise NotImplementedError


_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="model")


def _answer(response: httpx.Response) -> Answer:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return Answer(response.status_code, body)


class Client:
    """Requests of one project, sent once or as concurrent twins."""

    def __init__(self, url: str, key: str) -> None:
        self.http = [
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120.0)
            for _ in range(2)
        ]

    def close(self) -> None:
        for client in self.http:
            client.close()

    def send(self, method: str, path: str, body: Any = None, key: str | None = None, lane: int = 0) -> Answer:
        headers = {"Idempotency-Key": key} if key else {}
        response = self.http[lane].request(method, path, json=body, headers=headers)
        return _answer(response)

    def twins(self, first: Callable[[int], Answer], second: Callable[[int], Answer]) -> tuple[Answer, Answer]:
        """Both requests at once (released together by a barrier), each on its own connection."""
        barrier = threading.Barrier(2)

        def go(send: Callable[[int], Answer], lane: int) -> Answer:
            barrier.wait(10)
            return send(lane)

        a, b = _pool.submit(go, first, 0), _pool.submit(go, second, 1)
        return a.result(), b.result()


def _path(sandbox_id: str, action: str) -> tuple[str, str]:
    if action == "delete":
        return "DELETE", f"/v1/sandboxes/{sandbox_id}"
    return "POST", f"/v1/sandboxes/{sandbox_id}/{action}"


def _action_rule(action: str) -> Any:
    """The rule that sends lifecycle `action` to one of the live sandboxes, in a random mode (named before
    it is decorated: hypothesis keys its per-rule switches and its reports by the function's name)."""

    def send_action(self: LifecycleMachine, index: int, mode: str, other: str) -> None:
        self._act(index, action, mode, other)

    send_action.__name__ = send_action.__qualname__ = action
    decorate = rule(
        index=st.integers(0, 7), mode=st.sampled_from(MODES), other=st.sampled_from(sorted(ACTIONS))
    )
    return precondition(lambda self: self.live)(decorate(send_action))


class LifecycleMachine(RuleBasedStateMachine):
    """Random lifecycle sequences against `TARGET`; a subclass sets TARGET and TALLY."""

    TARGET: Target
    TALLY: Tally
    #: Rules a machine may leave out (the runsc machine: no crash injection).
    CRASHES = True
    #: At most this many live sandboxes (creates and forks stop there; each costs most on runsc).
    MAX_LIVE = 4

    def __init__(self) -> None:
        super().__init__()
        self.client = Client(self.TARGET.url, self.TARGET.project_key())
        self.live: dict[str, Expected] = {}
        self.deleted: set[str] = set()
        self.generations: dict[str, int] = {}
        self.steps_since_crash = 0
        self.timing: tuple[str, float] | None = None
        self.TALLY.sequences += 1

    def teardown(self) -> None:
        try:
            for sandbox_id in list(self.live):
                answer = self.client.send("DELETE", f"/v1/sandboxes/{sandbox_id}?wait=false")
                assert answer.status == 202, f"delete of {sandbox_id} at the end: {answer}"
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            for sandbox_id in list(self.live):
                while (answer := self.client.send("GET", f"/v1/sandboxes/{sandbox_id}")).status != 404:
                    assert time.monotonic() < deadline, f"{sandbox_id} not deleted at the end: {answer}"
                    time.sleep(0.1)
        finally:
            self.client.close()

    # -- helpers -------------------------------------------------------------------------------------------
    def _count(self, mode: str, answers: int = 1, rule_name: str = "") -> None:
        if not rule_name:  # the rule that sent, through _send_mode (an action: through _act)
            rule_name = sys._getframe(2).f_code.co_name
        if rule_name == "_act":
            rule_name = str(sys._getframe(2).f_locals["action"])
        self.TALLY.rules[rule_name] = self.TALLY.rules.get(rule_name, 0) + 1
        self.timing = (rule_name, time.monotonic())
        self.steps_since_crash += 1
        self.TALLY.steps += 1
        self.TALLY.requests += answers
        self.TALLY.modes[mode] = self.TALLY.modes.get(mode, 0) + 1

    def _pick(self, index: int) -> str:
        return sorted(self.live)[index % len(self.live)]

    def _view(self, sandbox_id: str) -> dict[str, Any]:
        answer = self.client.send("GET", f"/v1/sandboxes/{sandbox_id}")
        assert answer.status == 200, f"GET {sandbox_id}: {answer}"
        return dict(answer.body)

    def _check_refused(self, answer: Answer, outcome: Outcome, what: str) -> None:
        assert answer.status == 409 and answer.refused_state == outcome.state.value, (
            f"{what}: the table refuses it in '{outcome.state}', expected 409 naming it; got {answer}"
        )
        self.TALLY.refusals += 1

    def _send_mode(
        self, mode: str, method: str, path: str, body: Any, other_body: Any = None, other_path: str = ""
    ) -> list[Answer]:
        """Send one request in `mode`; the answers that must match the prediction (replays are checked
        here: the same status and body as the first answer)."""
        if mode == "once":
            self._count(mode)
            return [self.client.send(method, path, body)]
        if mode == "twice":
            self._count(mode, 2)
            return list(
                self.client.twins(*[lambda lane: self.client.send(method, path, body, lane=lane)] * 2)
            )
        key = f"k-{secrets.token_hex(6)}"
        self._count(mode, 2)
        if mode == "concurrent_key":
            a, b = self.client.twins(*[lambda lane: self.client.send(method, path, body, key, lane)] * 2)
            assert (a.status, a.body) == (b.status, b.body), (
                f"concurrent twins with one key differ: {a} / {b}"
            )
            return [a]
        first = self.client.send(method, path, body, key)
        if mode == "replay":
            again = self.client.send(method, path, body, key)
            assert (again.status, again.body) == (first.status, first.body), (
                f"replay of {method} {path} differs: {first} / {again}"
            )
            return [first]
        other = self.client.send(method, other_path or path, other_body, key)
        assert other.status == 409 and other.code == "conflict", (
            f"the key of {method} {path} reused for another request must be refused: {other}"
        )
        return [first]

    def _adopt(self, sandbox_id: str, view: dict[str, Any], state: State) -> None:
        assert view["state"] == state.value, f"{sandbox_id}: expected '{state}', the API says {view}"
        expected = self.live.setdefault(sandbox_id, Expected(state, int(view["generation"])))
        expected.state, expected.generation = state, int(view["generation"])

    def _settled(self, sandbox_id: str) -> dict[str, Any]:
        """The sandbox's view once state == desired and nothing is in flight (the routes wait for that)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            view = self._view(sandbox_id)
            settled = view["state"] == view["desired_state"] and not lifecycle.is_in_progress(view["state"])
            if settled or time.monotonic() > deadline:
                assert settled, f"{sandbox_id} did not settle: {view}"
                return view
            time.sleep(0.1)

    # -- rules: create and fork ----------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < self.MAX_LIVE)
    @rule(mode=st.sampled_from(MODES))
    def create(self, mode: str) -> None:
        body = {"template": "python", "limits": self.TARGET.limits, "wait": True}
        other = {**body, "env": {"OTHER": "body"}}
        answers = self._send_mode(mode, "POST", "/v1/sandboxes", body, other)
        ids = set()
        for answer in answers:
            assert answer.status == 201 and answer.body["state"] == "running", f"create: {answer}"
            ids.add(answer.body["id"])
            self._adopt(answer.body["id"], answer.body, State.RUNNING)
        assert len(ids) == len(answers), f"two creates without a key made one sandbox: {answers}"

    @precondition(lambda self: self.live and len(self.live) < self.MAX_LIVE)
    @rule(index=st.integers(0, 7), mode=st.sampled_from(MODES))
    def fork(self, index: int, mode: str) -> None:
        parent = self._pick(index)
        outcome = predict_use(self.live[parent].state)
        path = f"/v1/sandboxes/{parent}/fork"
        answers = self._send_mode(mode, "POST", path, {"count": 1}, {"count": 2})
        for answer in answers:
            if not outcome.accepted:
                self._check_refused(answer, outcome, f"fork of {parent}")
                continue
            assert answer.status == 201, f"fork of {parent} in '{self.live[parent].state}': {answer}"
            for child in answer.body["sandboxes"]:
                assert child["forked_from"] == parent and child["state"] == "running", child
                self._adopt(child["id"], child, State.RUNNING)
        if outcome.accepted:
            self._adopt(parent, self._settled(parent), State.RUNNING)

    # -- rules: lifecycle actions (one rule each: pause, resume, stop, start, suspend, restore, delete) ----
    def _act(self, index: int, action: str, mode: str, other: str) -> None:
        sandbox_id = self._pick(index)
        before = self.live[sandbox_id]
        outcome = predict_action(before.state, action)
        method, path = _path(sandbox_id, action)
        if mode == "other_body" and other == action:
            other = "pause" if action != "pause" else "resume"
        other_method, other_path = _path(sandbox_id, other)
        if mode == "other_body" and other_method != method:
            mode = "replay"  # a key reused across methods: covered by the other pairs
        answers = self._send_mode(mode, method, path, None, None, other_path)
        if mode == "twice":
            answers = self._twins_of_action(sandbox_id, action, outcome, answers)
        for answer in answers:
            self._check_action(sandbox_id, action, before, outcome, answer)
        if outcome.accepted and action == "delete":
            self.live.pop(sandbox_id)
            self._wait_gone(sandbox_id)
            self.deleted.add(sandbox_id)
        elif outcome.accepted:
            self._adopt(sandbox_id, self._settled(sandbox_id), outcome.state)
            if outcome.state == before.state and mode in KEYED_MODES:
                assert self.live[sandbox_id].generation == before.generation, "a no-op moved the generation"

    def _wait_gone(self, sandbox_id: str) -> None:
        """A delete answered: the sandbox is refused by the data plane at once, and gone (404) later."""
        refused = self.client.send("POST", f"/v1/sandboxes/{sandbox_id}/exec", {"cmd": "true"})
        assert refused.status in (404, 409), f"exec on deleted {sandbox_id} answers {refused}"
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (answer := self.client.send("GET", f"/v1/sandboxes/{sandbox_id}")).status != 404:
            assert answer.body["state"] == State.DELETING.value, f"deleted {sandbox_id} answers {answer}"
            assert time.monotonic() < deadline, f"{sandbox_id} not deleted in {SETTLE_TIMEOUT_S:.0f} s"
            time.sleep(0.05)

    pause = _action_rule("pause")
    resume = _action_rule("resume")
    stop = _action_rule("stop")
    start = _action_rule("start")
    suspend = _action_rule("suspend")
    restore = _action_rule("restore")
    delete = _action_rule("delete")

    def _twins_of_action(
        self, sandbox_id: str, action: str, outcome: Outcome, answers: list[Answer]
    ) -> list[Answer]:
        """Two concurrent identical actions: a refusal is refused twice; an accepted one is accepted by at
        least one twin, and the other twin asked for what is already wished, so it is accepted too, or it
        arrived after a delete finished (404)."""
        if not outcome.accepted:
            return answers
        if action == "delete":
            kept = [a for a in answers if a.status != 404]
            assert kept, f"both concurrent deletes of {sandbox_id} answered 404: {answers}"
            return kept
        return answers

    def _check_action(
        self, sandbox_id: str, action: str, before: Expected, outcome: Outcome, answer: Answer
    ) -> None:
        what = f"{action} of {sandbox_id} in '{before.state}'"
        if not outcome.accepted:
            self._check_refused(answer, outcome, what)
            return
        if action == "delete":
            # Answered once `deleting` (refused everywhere from then on); the teardown is the background's
            # (ADR 0073), so a late twin may already see `deleted`.
            assert answer.status == 202 and answer.body["state"] in ("deleting", "deleted"), (
                f"{what}: the table allows it, expected 202 'deleting'; got {answer}"
            )
            assert answer.body["desired_state"] == State.DELETED.value, f"{what}: {answer}"
            return
        assert answer.status == 200 and answer.body["state"] == outcome.state.value, (
            f"{what}: the table allows it, expected 200 '{outcome.state}'; got {answer}"
        )

    # -- rules: data plane, snapshots, rollback ------------------------------------------------------------
    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 7), mode=st.sampled_from(("once", "twice")))
    def exec(self, index: int, mode: str) -> None:
        sandbox_id = self._pick(index)
        outcome = predict_use(self.live[sandbox_id].state)
        word = secrets.token_hex(4)
        body = {"argv": ["echo", word]}
        for answer in self._send_mode(mode, "POST", f"/v1/sandboxes/{sandbox_id}/exec", body):
            if not outcome.accepted:
                self._check_refused(answer, outcome, f"exec in {sandbox_id}")
                continue
            assert answer.status == 200 and answer.body["exit_code"] == 0, f"exec in {sandbox_id}: {answer}"
            assert answer.body["stdout"] == f"{word}\n", answer.body
        if outcome.accepted:
            self._adopt(sandbox_id, self._settled(sandbox_id), State.RUNNING)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 7), full=st.booleans(), mode=st.sampled_from(("once", "twice")))
    def checkpoint(self, index: int, full: bool, mode: str) -> None:
        sandbox_id = self._pick(index)
        outcome = predict_use(self.live[sandbox_id].state)
        path = f"/v1/sandboxes/{sandbox_id}/snapshots"
        for answer in self._send_mode(mode, "POST", path, {"full": full}):
            if not outcome.accepted:
                self._check_refused(answer, outcome, f"checkpoint of {sandbox_id}")
                continue
            assert answer.status == 201 and answer.body["kind"] == ("full" if full else "disk"), answer
            self.live[sandbox_id].snapshots.append(answer.body["id"])
        if outcome.accepted:
            self._adopt(sandbox_id, self._settled(sandbox_id), State.RUNNING)

    @precondition(lambda self: any(e.snapshots for e in self.live.values()))
    @rule(index=st.integers(0, 7), which=st.integers(0, 7), mode=st.sampled_from(("once", "twice")))
    def rollback(self, index: int, which: int, mode: str) -> None:
        candidates = sorted(i for i, e in self.live.items() if e.snapshots)
        sandbox_id = candidates[index % len(candidates)]
        before = self.live[sandbox_id]
        snapshot_id = before.snapshots[which % len(before.snapshots)]
        outcome = (
            Outcome(True, State.RUNNING)
            if lifecycle.can(before.state, Event.ROLLBACK)
            else Outcome(False, before.state)
        )
        path = f"/v1/sandboxes/{sandbox_id}/rollback"
        answers = self._send_mode(mode, "POST", path, {"snapshot_id": snapshot_id})
        if mode == "twice" and outcome.accepted:
            # Rollback is not idempotent: of two at once, the second may find the first's rolling_back.
            losers = [a for a in answers if a.status == 409]
            for lost in losers:
                assert lost.code == "conflict" or lost.refused_state == State.ROLLING_BACK.value, lost
            answers = [a for a in answers if a.status != 409]
            assert answers, f"both concurrent rollbacks of {sandbox_id} were refused: {losers}"
        for answer in answers:
            if not outcome.accepted:
                self._check_refused(answer, outcome, f"rollback of {sandbox_id} in '{before.state}'")
                continue
            assert answer.status == 200 and answer.body["state"] == "running", (
                f"rollback of {sandbox_id} in '{before.state}' to {snapshot_id}: {answer}"
            )
        if outcome.accepted:
            self._adopt(sandbox_id, self._settled(sandbox_id), State.RUNNING)

    # -- rules: crash and recover --------------------------------------------------------------------------
    @precondition(
        lambda self: (
            self.CRASHES
            and self.steps_since_crash >= CRASH_EVERY
            and any(e.state == State.RUNNING for e in self.live.values())
        )
    )
    @rule(index=st.integers(0, 7))
    def crash_and_recover(self, index: int) -> None:
        """There is no recover route: `recover` is the reconciler's answer to a crash of the runtime. The
        sandbox must come back running, its crash counted, from a checkpoint of its own or on its disk."""
        running = sorted(i for i, e in self.live.items() if e.state == State.RUNNING)
        sandbox_id = running[index % len(running)]
        view = self._view(sandbox_id)
        self._count("crash", rule_name="crash_and_recover")
        self.steps_since_crash = 0
        self.TARGET.crash(sandbox_id, str(view["node_id"]))
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            now = self._view(sandbox_id)
            if now["crash_count"] > view["crash_count"] and now["state"] == "running" == now["desired_state"]:
                break
            assert time.monotonic() < deadline, f"{sandbox_id} not recovered from a crash: {now}"
            time.sleep(0.2)
        assert now["notice"], f"a recovery says how it recovered: {now}"
        events = self.client.send("GET", f"/v1/sandboxes/{sandbox_id}/events?kind=sandbox.recovered")
        assert events.status == 200 and len(events.body["events"]) == now["crash_count"], (
            f"{sandbox_id} crashed {now['crash_count']}x: one sandbox.recovered event each, got {events}"
        )
        if now["recovered_from"] is not None:
            # One of its own full checkpoints (a fork's checkpoint of it counts: it is the newest then).
            listing = self.client.send("GET", f"/v1/sandboxes/{sandbox_id}/snapshots")
            full = {snap["id"] for snap in listing.body["snapshots"] if snap["kind"] == "full"}
            assert now["recovered_from"] in full, f"recovered from {now['recovered_from']}, not one of {full}"
        self._adopt(sandbox_id, now, State.RUNNING)

    # -- invariants ----------------------------------------------------------------------------------------
    @invariant()
    def states_are_the_tables_and_settle(self) -> None:
        if self.timing is not None:
            self.TALLY.add_time(self.timing[0], time.monotonic() - self.timing[1])
        self.timing = None
        started = time.monotonic()
        try:
            self._states_are_the_tables_and_settle()
        finally:
            self.TALLY.add_time("invariants", time.monotonic() - started)

    def _states_are_the_tables_and_settle(self) -> None:
        for sandbox_id, expected in self.live.items():
            view = self._view(sandbox_id)
            state = lifecycle.parse_state(view["state"])  # a state of the table, or InvalidArgument
            assert state == expected.state, f"{sandbox_id}: the model says '{expected.state}', the API {view}"
            assert view["desired_state"] == view["state"], f"{sandbox_id} not converged: {view}"
            generation = int(view["generation"])
            assert generation >= self.generations.get(sandbox_id, 0), f"{sandbox_id}: generation went back"
            self.generations[sandbox_id] = generation

    @invariant()
    def deleted_stays_deleted(self) -> None:
        for sandbox_id in self.deleted:
            answer = self.client.send("GET", f"/v1/sandboxes/{sandbox_id}")
            assert answer.status == 404, f"deleted {sandbox_id} answers {answer}"
            assert self.TARGET.tombstone(sandbox_id) == State.DELETED.value

    @invariant()
    def one_copy_of_each(self) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            problems = self._copies_problems()
            if not problems or time.monotonic() > deadline:
                assert not problems, "; ".join(problems)
                return
            time.sleep(0.2)

    def _copies_problems(self) -> list[str]:
        holdings = self.TARGET.holdings()
        problems = []
        for sandbox_id, expected in self.live.items():
            holders = {node: held[sandbox_id] for node, held in holdings.items() if sandbox_id in held}
            if expected.state == State.SUSPENDED:
                if holders:
                    problems.append(f"suspended {sandbox_id} still held by {holders}")
                continue
            node_id = self._view(sandbox_id)["node_id"]
            if list(holders) != [node_id] or holders[node_id] != expected.state.value:
                problems.append(f"{sandbox_id} ('{expected.state}' on {node_id}) held by {holders}")
        for sandbox_id in self.deleted:
            holders = [node for node, held in holdings.items() if sandbox_id in held]
            if holders:
                problems.append(f"deleted {sandbox_id} still held by {holders}")
        return problems
