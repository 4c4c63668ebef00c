"""The configuration file of every role (space.cli.config_file): precedence flags > environment > file >
defaults, and hostile files refused with the file and the key named."""

from __future__ import annotations

import os
import pathlib

import pytest

from space.cli import config_file as cf
from space.controlplane.settings import ControlPlaneSettings
from space.core import errors
from space.node.agent.settings import NodeAgentSettings

FILE = pathlib.Path("/etc/space/space.toml")


def _write(tmp_path: pathlib.Path, text: str, mode: int = 0o600) -> pathlib.Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_file_environment_and_flags_layer_in_that_order(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(
        tmp_path,
        '[controlplane]\nlisten = "0.0.0.0:8443"\ndatabase = "postgresql://space@db.test/space"\n'
        "api_requests_per_s = 5\napi_request_burst = 9\n[node]\nheartbeat_interval_s = 2\n",
    )
    for name in ("SPACE_CONTROLPLANE_LISTEN", "SPACE_DATABASE_URL", "SPACE_API_REQUEST_BURST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPACE_API_REQUESTS_PER_S", "7")
    config = cf.read_config(path)
    run = cf.settings(cf.RunOptions, config, "controlplane", listen="127.0.0.1:9000", database=None)
    assert run.listen == "127.0.0.1:9000"  # the flag over the file
    assert run.database == "postgresql://space@db.test/space"  # the file (no flag given, no variable)
    assert run.data_dir == "/var/lib/space-controlplane"  # the default
    tunables = cf.settings(ControlPlaneSettings, config, "controlplane")
    assert tunables.api_requests_per_s == 7.0  # the environment over the file
    assert tunables.api_request_burst == 9  # the file
    monkeypatch.setenv("SPACE_NODE_LISTEN", "127.0.0.1:7071")
    assert cf.settings(cf.JoinOptions, config, "node").listen == "127.0.0.1:7071"
    assert cf.settings(NodeAgentSettings, config, "node").heartbeat_interval_s == 2.0


def test_no_file_means_environment_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3.test:9000")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)  # a session's S3 server fixture sets one
    objects = cf.settings(cf.ObjectsOptions, cf.read_config(None), "objects")
    assert objects.endpoint == "http://s3.test:9000"
    assert objects.secret_access_key is None


def test_export_fills_only_unset_variables(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[objects]\nendpoint = "http://s3.test:9000"\nregion = "eu-west-1"\n')
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    exported = cf.export_to_environment(cf.read_config(path), "objects", cf.ObjectsOptions)
    assert exported == {"AWS_ENDPOINT_URL_S3": "http://s3.test:9000"}
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-2"


def test_every_variable_names_one_setting_of_its_section() -> None:
    for section in cf.SECTIONS:
        names = [cf.env_name(model, key) for key, model in cf.section_keys(section).items()]
        assert len(names) == len(set(names)), section
        assert all(name.startswith(("SPACE_", "AWS_")) for name in names), section


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[controlplane]\nlistne = '1.2.3.4:80'\n", "[controlplane] listne: unknown key"),
        ("[contrlplane]\n", "unknown section [contrlplane]"),
        ("node_lost_after_s = 1\n", "outside any section"),
        ("[controlplane]\napi_requests_per_s = true\n", "[controlplane] api_requests_per_s: bool"),
        ("[controlplane]\napi_requests_per_s = -1\n", "[controlplane] api_requests_per_s: Input should be"),
        ("[controlplane]\napi_json_body_bytes = 'lots'\n", "[controlplane] api_json_body_bytes"),
        ("[controlplane]\ndatabase = ['postgresql://a']\n", "[controlplane] database: list"),
        ("[controlplane]\ndatabase = 'mysql://db.test/x'\n", "[controlplane] database"),
        ("[controlplane]\nlisten = '0.0.0.0:80; rm -rf /'\n", "[controlplane] listen"),
        ("[controlplane]\ntls_key = '../key.pem'\n", "[controlplane] tls_key"),
        ("[controlplane]\nnode_lost_after_s = 2\nfence_grace_s = 3\n", "[controlplane]: "),
        ("[controlplane.nested]\nx = 1\n", "[controlplane] nested: unknown key"),
        ("[node]\ncontrol_plane = 'file:///etc/passwd'\n", "[node] control_plane"),
        ("[node]\ntemplates = 'python; reboot'\n", "[node] templates"),
        ('[objects]\nendpoint = "http://s3.test/\\u0000"\n', "[objects] endpoint"),
        ("[controlplane\n", "not valid TOML"),
    ],
)
def test_hostile_files_are_refused_naming_file_and_key(text: str, expected: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        cf.parse_config(text, FILE)
    assert str(FILE) in caught.value.message
    assert expected in caught.value.message


def test_a_bad_variable_or_flag_is_named(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPACE_CONTROLPLANE_LISTEN", "nowhere")
    with pytest.raises(errors.InvalidArgument, match="environment variable SPACE_CONTROLPLANE_LISTEN"):
        cf.settings(cf.RunOptions, cf.read_config(None), "controlplane")
    monkeypatch.delenv("SPACE_CONTROLPLANE_LISTEN")
    with pytest.raises(errors.InvalidArgument, match="--listen"):
        cf.settings(cf.RunOptions, cf.read_config(None), "controlplane", listen="nowhere")


def test_a_secret_in_a_readable_file_is_refused(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path, "[objects]\nsecret_access_key = 'x'\n", mode=0o644)
    with pytest.raises(errors.PermissionDenied, match="chmod 600"):
        cf.read_config(path)
    path.chmod(0o600)
    assert cf.read_config(path).values("objects") == {"secret_access_key": "x"}


def test_a_missing_file_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.InvalidArgument, match=str(tmp_path / "absent.toml")):
        cf.read_config(tmp_path / "absent.toml")


def test_operations_guide_lists_every_setting_with_its_variable() -> None:
    guide = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    missing = [
        f"[{section}] {key}"
        for section in cf.SECTIONS
        for key, model in cf.section_keys(section).items()
        if f"| `{key}` | `{cf.env_name(model, key)}` |" not in guide
    ]
    assert missing == [], "docs/operations.md (Configuration) lacks these settings"
