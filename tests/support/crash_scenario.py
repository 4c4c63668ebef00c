"""The scenario of the crash-injection harness: one sandbox through every operation (create, exec, pause,
resume, stop, start, checkpoint, fork, rollback, suspend, restore, delete) against a CrashCluster whose
processes die at kill points on the way.

Each operation is driven like a patient client would: every request is retried while the control plane is
down or answers 5xx (creates, forks and checkpoints carry an Idempotency-Key, so a retry never makes a
second one; lifecycle actions are wishes, so asking again is a no-op), then the harness waits until every
sandbox settled (state == desired state, nothing in progress) and sweeps the invariants
(tests/support/invariants.py). What every step found is kept in `Outcome`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from space.core.lifecycle import IN_PROGRESS_STATES, State
from tests.support import cluster as c
from tests.support import invariants
from tests.support.crashcluster import CrashCluster

SETTLE_TIMEOUT_S = 300.0
SWEEP_GRACE_S = 20.0
RETRY_STATUSES = frozenset({500, 502, 503, 504})


@dataclass
class StepOutcome:
    operation: str
    seconds: float
    fired: dict[str, list[str]]
    problems: list[str]


@dataclass
class Outcome:
    steps: list[StepOutcome] = field(default_factory=list)

    def problems(self) -> list[str]:
        return [f"after {s.operation}: {p}" for s in self.steps for p in s.problems]


class Driver:
    def __init__(self, cluster: CrashCluster) -> None:
        self.cluster = cluster
        self.http = httpx.Client(
            base_url=cluster.cp.url, headers={"Authorization": f"Bearer {cluster.admin_key}"}, timeout=90
        )
        self.outcome = Outcome()

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, *, key: str | None = None, **kw: Any) -> httpx.Response:
        """`method path` until it is answered with something other than 5xx or a lost race."""
        headers = {"Idempotency-Key": key} if key else {}
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                answer = self.http.request(method, path, headers=headers, **kw)
            except httpx.HTTPError as exc:
                last = repr(exc)
            else:
                code = answer.json().get("error", {}).get("code") if answer.status_code >= 400 else None
                if answer.status_code not in RETRY_STATUSES and code != "conflict":
                    return answer
                last = f"{answer.status_code} {answer.text[:300]}"
            time.sleep(0.2)
        raise AssertionError(f"{method} {path} never answered: {last}\n{self.cluster.logs()}")

    def ok(self, method: str, path: str, **kw: Any) -> Any:
        answer = self.call(method, path, **kw)
        assert answer.status_code < 300, f"{method} {path}: {answer.status_code} {answer.text}"
        return (
            answer.json() if answer.headers.get("content-type", "").startswith("application/json") else None
        )

    def settled(self) -> bool:
        """Every record where it was asked to be, and the node done with what it is taking away (a copy
        the record no longer places there is deleted by the node after the record moved on)."""
        rows = self.cluster.db.list_sandboxes(self.cluster.project_id, include_deleted=True)
        if any(sb.state in IN_PROGRESS_STATES or sb.state != sb.desired_state for sb in rows):
            return False
        if not (self.cluster.cp_answers() and self.cluster.agent_answers()):
            return False
        try:
            node_id = self.cluster.node_id()
            listing = self.cluster.node.listing()
        except (AssertionError, OSError, httpx.HTTPError, StopIteration):
            return False
        placed = {sb.id for sb in rows if sb.node_id == node_id and sb.state in invariants.ON_A_NODE}
        return all(sandbox_id in placed for sandbox_id in listing)

    def step(self, operation: str, action: Callable[[], None]) -> None:
        before = self.cluster.fired()
        started = time.monotonic()
        action()
        try:
            c.wait_for(
                self.settled, timeout=SETTLE_TIMEOUT_S, interval=0.1, what=f"settled after {operation}"
            )
        except AssertionError as exc:
            rows = [
                (sb.id, sb.state.value, sb.desired_state.value, sb.node_id, sb.error_code, sb.error)
                for sb in self.cluster.db.list_sandboxes(self.cluster.project_id, include_deleted=True)
            ]
            raise AssertionError(
                f"{exc}\nrecords: {rows}\nfired: {self.cluster.fired()}\ndeaths: {self.cluster.deaths}\n"
                f"{self.cluster.logs()}"
            ) from exc
        # "Nothing orphaned remains" is an eventual property: a stopped runtime's container is retired in
        # the background (helper runtime.stop), so the sweep is repeated for a short grace; a real leak stays.
        problems = self.cluster.sweep()
        grace_ends = time.monotonic() + SWEEP_GRACE_S
        while problems and time.monotonic() < grace_ends:
            time.sleep(0.5)
            problems = self.cluster.sweep()
        after = self.cluster.fired()
        fired = {name: sorted(after[name] - before[name]) for name in after if after[name] - before[name]}
        self.outcome.steps.append(StepOutcome(operation, time.monotonic() - started, fired, problems))

    def state(self, sandbox_id: str) -> State:
        sb = self.cluster.db.load_sandbox(sandbox_id)
        assert sb is not None
        return sb.state


def exec_echo(driver: Driver, sandbox_id: str, word: str) -> None:
    answer = driver.ok("POST", f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": f"echo {word}"})
    assert answer["stdout"] == f"{word}\n", answer


def run_scenario(cluster: CrashCluster) -> Outcome:
    """Every operation once, in an order each one allows; returns what each step found."""
    driver = Driver(cluster)
    ids: dict[str, str] = {}
    try:

        def create() -> None:
            body = {"template": "python", "wait": False}
            ids["sb"] = driver.ok("POST", "/v1/sandboxes", key="crash-create", json=body)["id"]

        def use() -> None:
            exec_echo(driver, ids["sb"], "alive")
            driver.ok(
                "PUT", f"/v1/sandboxes/{ids['sb']}/files", params={"path": "/work/kept"}, content=b"kept"
            )

        def act(action: str) -> Callable[[], None]:
            return lambda: driver.ok("POST", f"/v1/sandboxes/{ids['sb']}/{action}", params={"wait": "false"})

        def checkpoint() -> None:
            snap = driver.ok(
                "POST", f"/v1/sandboxes/{ids['sb']}/snapshots", key="crash-ckpt", json={"full": True}
            )
            ids["snap"] = snap["id"]

        def fork() -> None:
            forked = driver.ok("POST", f"/v1/sandboxes/{ids['sb']}/fork", key="crash-fork", json={"count": 1})
            ids["child"] = forked["sandboxes"][0]["id"]

        def rollback() -> None:
            # After a death mid-rollback the record may be busy (the step in flight, or recovery of a
            # half-done rollback): a patient client waits until it settled and asks again.
            while True:
                path = f"/v1/sandboxes/{ids['sb']}/rollback"
                answer = driver.call("POST", path, json={"snapshot_id": ids["snap"]})
                if answer.status_code == 200:
                    return
                assert answer.status_code == 409, (answer.status_code, answer.text)
                c.wait_for(
                    driver.settled, timeout=SETTLE_TIMEOUT_S, interval=0.1, what="settled to roll back"
                )

        def restored() -> None:
            act("restore")()
            c.wait_for(
                lambda: driver.state(ids["sb"]) == State.RUNNING, timeout=SETTLE_TIMEOUT_S, what="restored"
            )
            read = driver.call("GET", f"/v1/sandboxes/{ids['sb']}/files", params={"path": "/work/kept"})
            assert read.status_code == 200 and read.content == b"kept", (read.status_code, read.content[:200])
            exec_echo(driver, ids["sb"], "back")

        def delete(which: str) -> Callable[[], None]:
            return lambda: driver.ok("DELETE", f"/v1/sandboxes/{ids[which]}", params={"wait": "false"})

        driver.step("create", create)
        driver.step("exec", use)
        for action in ("pause", "resume", "stop", "start"):
            driver.step(action, act(action))
        driver.step("checkpoint", checkpoint)
        driver.step("fork", fork)
        driver.step("delete fork", delete("child"))
        driver.step("rollback", rollback)
        driver.step("suspend", act("suspend"))
        driver.step("restore", restored)
        driver.step("delete", delete("sb"))
        return driver.outcome
    finally:
        driver.close()
