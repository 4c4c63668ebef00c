"""The operator's node routes over HTTP and the SDK (docs/adr/0065-node-operations.md), on the shared fake
cluster (one control plane, one fake-driver node): org admin keys only (a project's keys, even its admin
ones, are a 403), an unknown node a 404, a request the node's admin state refuses a 409 naming it, a
cordon stops placement and keeps running sandboxes, removal refuses a node that holds sandboxes. The shared
node is uncordoned again whatever happens. (What a drain moves: tests/controlplane/test_node_drain.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from space.core import errors
from space.sdk import Space
from tests.support import cluster as c

fake_cluster, project = c.fake_cluster, c.project

ROUTES = [
    ("GET", "/v1/cluster/nodes/{node}"),
    ("POST", "/v1/cluster/nodes/{node}/cordon"),
    ("POST", "/v1/cluster/nodes/{node}/uncordon"),
    ("POST", "/v1/cluster/nodes/{node}/drain"),
    ("DELETE", "/v1/cluster/nodes/{node}"),
]


@pytest.fixture
def admin(fake_cluster: c.Cluster) -> Iterator[Space]:
    with fake_cluster.sdk(fake_cluster.admin_key) as space:
        yield space
        for node in space.nodes.list():
            space.nodes.uncordon(node.id)


def test_project_keys_are_refused_and_unknown_nodes_are_404(
    fake_cluster: c.Cluster, project: c.Project, admin: Space
) -> None:
    node_id = admin.nodes.list()[0].id
    _, project_admin = project.new_key("admin")
    for key in (project.key, project_admin):
        for method, path in ROUTES:
            refused = project.http(key).request(method, path.format(node=node_id))
            assert refused.status_code == 403, (method, path, refused.text)
            assert refused.json()["error"]["code"] == "permission_denied"
    for unknown in ("node-aaaaaaaaaaaaaaaaaaaaaaaaaa", "x" * 300, "%27%3B--"):
        for method, path in ROUTES:
            answer = fake_cluster.http(fake_cluster.admin_key).request(method, path.format(node=unknown))
            assert answer.status_code == 404, (method, path, unknown, answer.text)
    assert admin.nodes.get(node_id).admin == "active"  # nothing above changed it


def test_cordon_stops_placement_and_remove_refuses_a_node_with_sandboxes(
    fake_cluster: c.Cluster, project: c.Project, admin: Space
) -> None:
    with project.sdk() as space:
        running = space.sandboxes.create(limits=c.SMALL)
        node = admin.nodes.list()[0]
        assert node.status == "ready" and node.admin == "active" and node.sandboxes >= 1
        assert not any(k.startswith("space.") for k in node.labels)
        assert admin.nodes.cordon(node.id).admin == "cordoned"
        assert admin.nodes.cordon(node.id).admin == "cordoned"  # a retry is a no-op
        with pytest.raises(errors.SpaceError) as refused:
            admin.nodes.remove(node.id)
        assert refused.value.code == "invalid_state" and "cordoned" in refused.value.message
        # The only node is cordoned: a create waits for a node (retried) instead of landing on it.
        waiting = space.sandboxes.create(limits=c.SMALL, wait=False)
        record = c.wait_for(
            lambda: (r := fake_cluster.store.load_sandbox(waiting.id)) and r.error_code and r,
            timeout=20, what="the create refused a place",
        )  # fmt: skip
        assert record.node_id is None and record.error_code == "resource_exhausted"
        assert space.sandboxes.get(running.id).state == "running"  # a cordon moves nothing
        assert admin.nodes.uncordon(node.id).admin == "active"
        c.wait_for(
            lambda: space.sandboxes.get(waiting.id).state == "running", timeout=20, what="placed again"
        )
    assert fake_cluster.store.get_node(node.id) is not None


def test_the_cli(fake_cluster: c.Cluster, project: c.Project, admin: Space) -> None:
    """`space node list|cordon|uncordon|remove` against the shared node (a drain would move other tests'
    sandboxes: the real two-node test drives that), and the CLI's errors for a project key and an
    unknown node."""
    from typer.testing import CliRunner

    from space.cli.main import app

    node_id = admin.nodes.list()[0].id

    def space(key: str, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, ["--url", fake_cluster.url, "--api-key", key, "node", *args])
        return result.exit_code, result.output

    admin_key = fake_cluster.admin_key
    assert space(admin_key, "cordon", node_id) == (0, f"{node_id}: cordoned\n")
    code, listed = space(admin_key, "list")
    assert code == 0 and "ADMIN" in listed and f"{node_id}  ready" in listed and "cordoned" in listed, listed
    code, as_json = space(admin_key, "list", "--json")
    assert code == 0 and json.loads(as_json)[0]["admin"] == "cordoned"
    assert space(admin_key, "uncordon", node_id) == (0, f"{node_id}: active\n")
    code, refused = space(project.key, "cordon", node_id)
    assert code != 0 and "permission_denied" in refused, refused
    code, missing = space(admin_key, "remove", "node-aaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert code != 0 and "not_found" in missing, missing
    assert admin.nodes.get(node_id).admin == "active"
