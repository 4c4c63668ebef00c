"""A control plane killed (SIGKILL) in the middle of a template build converges when it starts again
(ADR 0055): the `building` row its dead process held is failed with the reason at start-up (its owner is a
dead process of this host: no lease wait), and the node is asked to drop what the build left. The node is a
scripted one on loopback whose build stream never ends (the real node's build is tested in tests/node),
enrolled in the store with a sealed RPC token; the control plane is a real subprocess."""

from __future__ import annotations

import json
import pathlib
import secrets
import threading
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from space.controlplane.nodes import RpcTokenSeal
from space.controlplane.store.engine import sqlite_url
from space.controlplane.store.records import TemplateRecord
from space.core.ids import new_node_id
from tests.support import cluster as c
from tests.support.hop import Served, tcp_listener
from tests.support.loop import BackgroundLoop

BIG = {"cpus": 64, "memory_mb": 1 << 20, "sandboxes": 64}


def _scripted_node(seen: dict[str, list[str]]) -> FastAPI:
    app = FastAPI()

    @app.post("/node/v1/templates/{name}/build")
    async def build(name: str, request: Request) -> StreamingResponse:
        seen["builds"].append(name)

        async def endless() -> AsyncIterator[bytes]:
            yield (json.dumps({"log": f"building {name}"}) + "\n").encode()
            while (await request.receive())["type"] != "http.disconnect":
                pass  # until the control plane's connection goes

        return StreamingResponse(endless(), media_type="application/x-ndjson")

    @app.delete("/node/v1/templates/{name}")
    async def delete(name: str) -> dict[str, object]:
        seen["deleted"].append(name)
        return {"name": name, "deleted": True}

    return app


def test_a_build_whose_control_plane_was_killed_is_failed_at_its_restart(tmp_path: pathlib.Path) -> None:
    seen: dict[str, list[str]] = {"builds": [], "deleted": []}
    loop = BackgroundLoop()
    listener, url = tcp_listener()
    served = Served(loop, _scripted_node(seen), [listener])
    token_file = tmp_path / "node.token"
    token_file.write_text(secrets.token_urlsafe(32))
    database_url = sqlite_url(tmp_path)
    store, org_id, project_id, _admin = c.bootstrap(database_url)
    _key, key = store.create_api_key(project_id, org_id, "member")
    cp = c.ControlPlane(tmp_path, token_file, database_url=database_url, name="cp")
    beating = threading.Event()
    seal = RpcTokenSeal(token_file.read_text())
    node = store.enrol_node(
        new_node_id(), url, identity=secrets.token_hex(16),
        seal_rpc_token=lambda node_id: seal.seal(node_id, secrets.token_urlsafe(24)),
    )  # fmt: skip

    def heartbeats() -> None:  # the scripted node stays ready (and the build node: it holds the base)
        while not beating.wait(1.0):
            store.heartbeat(node.id, used={}, templates=["python", "base"], capacity=BIG)

    beater = threading.Thread(target=heartbeats, daemon=True)
    try:
        store.heartbeat(node.id, used={}, templates=["python", "base"], capacity=BIG)
        beater.start()
        cp.start_and_wait()
        api = httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        spec = {"from": "python", "steps": [{"run": "true"}]}
        answer = api.post("/v1/templates", json={"name": "doomed", "spec": spec})
        assert answer.status_code == 202, answer.text
        made = answer.json()
        c.wait_for(lambda: seen["builds"] == [made["node_name"]], timeout=30, what="the build on the node")
        cp.kill()
        record = store.get_template(project_id, made["id"])
        assert record is not None and record.status == "building"
        cp.start_and_wait()

        def settled() -> TemplateRecord | None:
            record = store.get_template(project_id, made["id"])
            return record if record is not None and record.status == "failed" else None

        failed = c.wait_for(settled, timeout=30, what="the abandoned build failed")
        assert failed is not None and "control plane" in (failed.error or "")
        c.wait_for(lambda: made["node_name"] in seen["deleted"], timeout=30, what="the node's copy dropped")
        again = api.post("/v1/templates", json={"name": "doomed", "spec": spec})  # the name is the user's
        assert again.status_code == 409, again.text  # (a failed template keeps its name until deleted)
        assert api.delete("/v1/templates/doomed").status_code == 200
        rebuilt = api.post("/v1/templates", json={"name": "doomed", "spec": spec})
        assert rebuilt.status_code == 202, rebuilt.text  # the restarted control plane builds again
        c.wait_for(lambda: len(seen["builds"]) == 2, timeout=30, what="the second build on the node")
    finally:
        beating.set()
        cp.kill()
        served.stop()
        loop.close()
        store.close()
