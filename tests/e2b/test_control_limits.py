"""The E2B control app in process over a real store (no node needed): each key's requests are rate-limited
as on SPACE's API (429 in E2B's body with Retry-After), separately per key."""

from __future__ import annotations

import dataclasses
import pathlib

from e2b.api.client.models import Error
from starlette.testclient import TestClient

from space.controlplane.api.app import create_app
from space.controlplane.e2b.control import create_control_app
from tests.support.cluster import bootstrap


def test_each_key_is_rate_limited(tmp_path: pathlib.Path) -> None:
    store, org_id, project_id, admin_key = bootstrap(f"sqlite:///{tmp_path / 'cp.db'}")
    try:
        services = create_app(store, node_token="t" * 32, run_reconciler=False).state.services
        slow = services.settings.model_copy(update={"api_requests_per_s": 0.01, "api_request_burst": 3})
        app = create_control_app(dataclasses.replace(services, settings=slow))
        _record, other_key = store.create_api_key(project_id, org_id, "read-only", shape="e2b")
        client = TestClient(app)
        for _ in range(3):
            assert client.get("/v2/sandboxes", headers={"X-API-Key": admin_key}).status_code == 200
        refused = client.get("/v2/sandboxes", headers={"X-API-Key": admin_key})
        assert refused.status_code == 429 and Error.from_dict(refused.json()).code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert client.get("/v2/sandboxes", headers={"X-API-Key": other_key}).status_code == 200
        # A request without a valid key is refused before it costs a token of anyone's.
        assert client.get("/v2/sandboxes", headers={"X-API-Key": "e2b_00"}).status_code == 401
    finally:
        store.close()
