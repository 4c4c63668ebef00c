"""E2B's default template is SPACE's `base` (ADR 0057), through E2B's own SDK against a real installation:
commands run as `user` in /home/user with passwordless sudo, `user="root"` is root, and uploads (SDK
writes, signed upload URLs, MakeDir) are owned by the user unless they name another; relative paths land in
the user's home; SPACE's own API writes as the user named by `user`."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.support.cluster import RealCluster, real_cluster  # noqa: F401 - module-bound session fixture
from tests.support.e2b_cluster import e2b_sandbox

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def sbx(real_cluster: RealCluster) -> Iterator[Sandbox]:  # noqa: F811
    with e2b_sandbox(real_cluster) as made:
        yield made


def test_the_default_template_is_base(sbx: Sandbox) -> None:
    assert Sandbox.get_info(sbx.sandbox_id, api_key=sbx.connection_config.api_key,
                            api_url=sbx.connection_config.api_url).template_id == "base"  # fmt: skip
    assert (
        sbx.commands.run("whoami; pwd; echo $HOME; sudo -n id -u").stdout
        == "user\n/home/user\n/home/user\n0\n"
    )
    assert sbx.commands.run("whoami; pwd", user="root").stdout == "root\n/home/user\n"
    assert sbx.commands.run("git --version && curl --version >/dev/null && echo tools").stdout.endswith(
        "tools\n"
    )


def test_uploads_belong_to_the_user_unless_they_name_another(sbx: Sandbox) -> None:
    name = f"up-{secrets.token_hex(4)}"
    written = sbx.files.write(f"{name}/notes.txt", "relative")  # relative: the user's home
    assert written.path == f"/home/user/{name}/notes.txt"
    info = sbx.files.get_info(f"/home/user/{name}/notes.txt")
    assert (info.owner, info.group) == ("user", "user")
    assert sbx.files.get_info(f"/home/user/{name}").owner == "user"
    sbx.files.write(f"/tmp/{name}-root.txt", "x", user="root")
    assert sbx.files.get_info(f"/tmp/{name}-root.txt").owner == "root"
    assert sbx.files.make_dir(f"/tmp/{name}-dir/sub") is True
    assert sbx.files.get_info(f"/tmp/{name}-dir").owner == "user"
    with httpx.Client(timeout=60) as http:
        path = f"/tmp/{name}-url.txt"
        uploaded = http.post(sbx.upload_url(path), files={"file": (path, b"via url")})
        assert uploaded.status_code == 200, uploaded.text
    assert sbx.files.get_info(path).owner == "user"
    # The user may change what it was given, without sudo.
    assert sbx.commands.run(f"echo more >> /home/user/{name}/notes.txt && echo ok").stdout == "ok\n"


def test_space_s_api_writes_as_the_user_it_names(real_cluster: RealCluster, sbx: Sandbox) -> None:  # noqa: F811
    sandbox = real_cluster.sdk().sandboxes.get(sbx.sandbox_id)  # the same sandbox through SPACE's own API
    sandbox.files.write("/tmp/api-default.txt", b"x")
    sandbox.files.write("/tmp/api-root.txt", b"x", user="root")
    owners = sandbox.exec("stat -c %U /tmp/api-default.txt /tmp/api-root.txt; whoami").stdout
    assert owners.split() == ["user", "root", "user"]
