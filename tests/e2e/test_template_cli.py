"""`space template build` end to end (ADR 0055): the CLI's commands against the shared REAL cluster (control
plane, runsc node, root helper). The build has run steps only, so it needs no network: it runs inside a
build sandbox on the node, and a sandbox created from the result sees what the steps wrote, with the
template's environment. (A failing build's exit code and reason, options, space-template.toml and the
other commands are checked against a scripted node in tests/controlplane/test_templates_api.py.)"""

from __future__ import annotations

import secrets

import pytest
from typer.testing import CliRunner, Result

from space.cli import main as cli_main
from space.sdk import NotFound, Space
from tests.support import cluster as c

real_cluster = c.real_cluster

pytestmark = pytest.mark.root


def _cli(cluster: c.RealCluster, *args: str) -> Result:
    return CliRunner().invoke(
        cli_main.app, ["--url", cluster.url, "--api-key", cluster.api_key, "template", *args]
    )


def _gone(sp: Space, sandbox_id: str) -> bool:
    try:
        sp.sandboxes.get(sandbox_id)
    except NotFound:
        return True
    return False


def test_a_template_built_through_the_cli_makes_sandboxes(real_cluster: c.RealCluster) -> None:
    name = f"cli-{secrets.token_hex(3)}"
    built = _cli(
        real_cluster, "build", name, "--from", "python",
        "--run", "echo built-by-the-cli > /etc/built-by && id -un >> /etc/built-by",
        "--env", "GREETING=hello",
    )  # fmt: skip
    assert built.exit_code == 0, built.output
    template_id = built.stdout.strip()
    assert template_id.startswith("tpl_"), built.output
    assert "build finished: template ready" in built.stderr  # the log was streamed
    with real_cluster.sdk() as sp:
        sandbox = sp.sandboxes.create(template=name)
        try:
            assert sandbox.data["template"] == template_id.replace("tpl_", "tpl-")  # its node-level name
            done = sandbox.exec("cat /etc/built-by; echo $GREETING")
            assert done.stdout.split() == ["built-by-the-cli", "root", "hello"], done
            in_use = _cli(real_cluster, "delete", name)
            assert in_use.exit_code == 4 and "conflict" in in_use.stderr, in_use.output
        finally:
            sandbox.delete()
            c.wait_for(lambda: _gone(sp, sandbox.id), timeout=120, what="the template's sandbox deleted")
    listed = _cli(real_cluster, "list")
    assert listed.exit_code == 0, listed.output
    assert {line.split()[1]: line.split()[2] for line in listed.stdout.splitlines()[1:]}[name] == "ready"
    gone = _cli(real_cluster, "delete", template_id)
    assert gone.exit_code == 0, gone.output
    missing = _cli(real_cluster, "get", name)
    assert missing.exit_code == 3 and "not_found" in missing.stderr
