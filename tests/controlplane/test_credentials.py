"""The credential store below the HTTP layer, on a real (SQLite) store: scope resolution, the encrypted
vault (no plaintext canary in the database or vault files), placeholders, validation errors naming their
field, audit entries written with every change, and what a node is handed."""

from __future__ import annotations

import os
import pathlib
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from space.controlplane.credentials import spec
from space.controlplane.credentials.service import MASTER_KEY_FILENAME, CredentialService
from space.controlplane.credentials.vault import DirectoryBlobs, EncryptedLocalVault, load_master_key
from space.controlplane.store import Store, migrate, sqlite_url
from space.controlplane.store.credentials import CredentialFields, CredentialStore
from space.controlplane.store.records import SandboxRecord
from space.core import errors


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: pathlib.Path, clock: Clock) -> Iterator[Store]:
    url = sqlite_url(tmp_path / "cp")
    migrate(url)
    made = Store(url, clock=clock)
    yield made
    made.close()


@pytest.fixture
def service(store: Store, tmp_path: pathlib.Path) -> CredentialService:
    return CredentialService.open(store, tmp_path / "cp")


def canary() -> str:
    return "CANARY-" + secrets.token_hex(16)


def db_bytes(directory: pathlib.Path) -> bytes:
    """Everything SQLite keeps on disk for the database in `directory` (main file, WAL, shared memory)."""
    return b"".join(
        p.read_bytes() for p in sorted(directory.iterdir()) if p.name.startswith("controlplane.db")
    )


def put(
    service: CredentialService,
    org: str,
    name: str,
    value: str | None,
    *,
    scope: spec.Scope = "project",
    project: str | None = None,
    sandbox: str | None = None,
    hosts: list[str] | None = None,
    expires_at: datetime | None = None,
    rate: int | None = None,
) -> str:
    fields = CredentialFields(hosts=hosts or ["api.example.com"], expires_at=expires_at, rate_per_minute=rate)
    change = service.put(
        org_id=org, project_id=project, sandbox_id=sandbox, scope=scope, name=name, fields=fields,
        value=value.encode() if value is not None else None, actor="key:test",
    )  # fmt: skip
    return change.record.id


@pytest.fixture
def tenancy(store: Store) -> dict[str, str]:
    org = store.create_org("acme")
    p1 = store.create_project(org.id, "one")
    p2 = store.create_project(org.id, "two")
    s1 = store.create_sandbox(p1.id, "python")
    s2 = store.create_sandbox(p1.id, "python")
    s3 = store.create_sandbox(p2.id, "python")
    return {"org": org.id, "p1": p1.id, "p2": p2.id, "s1": s1.id, "s2": s2.id, "s3": s3.id}


# -- scopes --------------------------------------------------------------------------------------------------
def test_most_specific_scope_wins(service: CredentialService, tenancy: dict[str, str]) -> None:
    t = tenancy
    org_cred = put(service, t["org"], "gh", "org-value", scope="org")
    project_cred = put(service, t["org"], "gh", "p1-value", scope="project", project=t["p1"])
    sandbox_cred = put(service, t["org"], "gh", "s1-value", scope="sandbox", project=t["p1"], sandbox=t["s1"])
    resolve = service.credentials.resolve

    def winner(project: str, sandbox: str) -> str | None:
        record = resolve(t["org"], project, sandbox, ["gh"])["gh"]
        return record.id if record else None

    assert winner(t["p1"], t["s1"]) == sandbox_cred  # its own
    assert winner(t["p1"], t["s2"]) == project_cred  # a sibling sees the project's, never s1's
    assert winner(t["p2"], t["s3"]) == org_cred  # another project sees only the org's
    service.delete(t["s1"], "gh", actor="key:test")
    assert winner(t["p1"], t["s1"]) == project_cred
    service.delete(t["p1"], "gh", actor="key:test")
    assert winner(t["p1"], t["s1"]) == org_cred
    assert resolve(t["org"], t["p1"], t["s1"], ["nope"]) == {"nope": None}


def test_listing_shows_the_org_and_own_project_only(
    service: CredentialService, tenancy: dict[str, str]
) -> None:
    t = tenancy
    put(service, t["org"], "shared", "v", scope="org")
    put(service, t["org"], "mine", "v", project=t["p1"])
    put(service, t["org"], "theirs", "v", project=t["p2"])
    put(service, t["org"], "sb", "v", scope="sandbox", project=t["p1"], sandbox=t["s1"])
    names = {c.name for c in service.credentials.list_credentials(t["org"], t["p1"])}
    assert names == {"shared", "mine", "sb"}
    assert {c.name for c in service.credentials.list_credentials(t["org"], t["p2"])} == {"shared", "theirs"}


def test_a_name_is_unique_per_owner_and_a_put_updates(
    service: CredentialService, tenancy: dict[str, str]
) -> None:
    t = tenancy
    first = put(service, t["org"], "k", "one", project=t["p1"])
    again = put(service, t["org"], "k", "two", project=t["p1"])
    assert first == again
    record = service.credentials.get_credential(t["p1"], "k")
    assert record is not None and record.version == 2
    assert service.backend(record.vault).get(record.vault_ref) == b"two"


# -- the vault -----------------------------------------------------------------------------------------------
def test_database_never_holds_a_plaintext_value(
    service: CredentialService, tenancy: dict[str, str], tmp_path: pathlib.Path
) -> None:
    secret = canary()
    put(service, tenancy["org"], "k", secret, project=tenancy["p1"])
    rotated = canary()
    put(service, tenancy["org"], "k", rotated, project=tenancy["p1"])
    record = service.credentials.get_credential(tenancy["p1"], "k")
    assert record is not None
    assert service.backend(record.vault).get(record.vault_ref).decode() == rotated  # it does round-trip
    service.store.engine.dispose()  # flush nothing hidden in connections; then look at the files
    stored = db_bytes(tmp_path / "cp")
    assert stored, "the database files exist"
    for value in (secret, rotated):
        assert value.encode() not in stored
        assert value.encode().hex().encode() not in stored
    # The replaced value is gone from the vault, not only unreferenced.
    assert len(service.credentials.unreferenced_blobs()) == 0


def test_directory_vault_holds_only_ciphertext(tmp_path: pathlib.Path) -> None:
    vault = EncryptedLocalVault.open(tmp_path / "master.key", DirectoryBlobs(tmp_path / "blobs"))
    secret = canary()
    ref = vault.put("prj-x.api", secret.encode())
    files = list((tmp_path / "blobs").iterdir())
    assert [f.name for f in files] == [ref]
    assert secret.encode() not in files[0].read_bytes()
    assert oct(files[0].stat().st_mode & 0o777) == oct(0o600)
    assert vault.get(ref) == secret.encode()
    vault.delete(ref)
    vault.delete(ref)  # idempotent
    with pytest.raises(errors.NotFound):
        vault.get(ref)


def test_sealed_values_are_bound_to_their_reference_and_key(tmp_path: pathlib.Path) -> None:
    blobs = DirectoryBlobs(tmp_path / "blobs")
    vault = EncryptedLocalVault.open(tmp_path / "master.key", blobs)
    ref_a = vault.put("a", b"value-a")
    ref_b = vault.put("b", b"value-b")
    sealed_a = blobs.get_blob(ref_a)
    assert sealed_a is not None
    blobs.put_blob(ref_b, sealed_a)  # swapped: must not open as b's value
    with pytest.raises(errors.Internal):
        vault.get(ref_b)
    tampered = bytearray(sealed_a)
    tampered[-1] ^= 1
    blobs.put_blob(ref_a, bytes(tampered))
    with pytest.raises(errors.Internal):
        vault.get(ref_a)
    other = EncryptedLocalVault(secrets.token_bytes(32), blobs)
    ref_c = vault.put("c", b"value-c")
    with pytest.raises(errors.Internal):
        other.get(ref_c)


def test_master_key_file_is_private_and_stable(tmp_path: pathlib.Path) -> None:
    path = tmp_path / MASTER_KEY_FILENAME
    key = load_master_key(path)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert load_master_key(path) == key  # a second start reads the same key
    os.chmod(path, 0o644)
    with pytest.raises(errors.PermissionDenied):
        load_master_key(path)
    os.chmod(path, 0o600)
    path.write_bytes(b"short")
    with pytest.raises(errors.Internal):
        load_master_key(path)


def test_a_failed_put_leaves_no_value_behind(service: CredentialService, tenancy: dict[str, str]) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        service.put(
            org_id=tenancy["org"], project_id=tenancy["p1"], sandbox_id=None, scope="project", name="k",
            fields=CredentialFields(hosts=None), value=b"secret", actor="key:test",
        )  # fmt: skip
    assert caught.value.details["field"] == "hosts"
    assert service.credentials.unreferenced_blobs() == []
    assert service.credentials.get_credential(tenancy["p1"], "k") is None


# -- placeholders --------------------------------------------------------------------------------------------
def test_placeholders_are_random_and_never_derived_from_the_value(
    service: CredentialService, tenancy: dict[str, str]
) -> None:
    made = {spec.new_placeholder("OpenAI.key") for _ in range(2000)}
    assert len(made) == 2000
    for placeholder in made:
        assert placeholder.startswith("space-cred-openai-key-")
        tail = placeholder.rsplit("-", 1)[1]
        assert len(tail) == 16 and tail.isalnum() and tail.islower()
    same = "the-same-value"
    put(service, tenancy["org"], "a", same, project=tenancy["p1"])
    put(service, tenancy["org"], "a", same, project=tenancy["p2"])
    one = service.credentials.get_credential(tenancy["p1"], "a")
    two = service.credentials.get_credential(tenancy["p2"], "a")
    assert one is not None and two is not None
    assert one.placeholder != two.placeholder and same not in one.placeholder
    put(service, tenancy["org"], "a", "rotated", project=tenancy["p1"])
    rotated = service.credentials.get_credential(tenancy["p1"], "a")
    assert rotated is not None and rotated.placeholder == one.placeholder  # kept across rotation


# -- validation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: spec.validate_name("1abc"), "name"),
        (lambda: spec.validate_name("a/b"), "name"),
        (lambda: spec.normalize_hosts([]), "hosts"),
        (lambda: spec.normalize_hosts(["ok.example.com", "bad host"]), "hosts[1]"),
        (lambda: spec.normalize_hosts(["ok.example.com", "*"]), "hosts[1]"),
        (lambda: spec.normalize_hosts(["*.com"]), "hosts[0]"),
        (lambda: spec.normalize_hosts(["https://x.example.com/path"]), "hosts[0]"),
        (lambda: spec.normalize_hosts(["a*.example.com"]), "hosts[0]"),
        (lambda: spec.parse_injection("header", "no colon"), "header"),
        (lambda: spec.parse_injection("header", "X-Key: static"), "header"),
        (lambda: spec.parse_injection("header", "X-Key: {value}{value}"), "header"),
        (lambda: spec.parse_injection("header", "Bad Name: {value}"), "header"),
        (lambda: spec.parse_injection("header", "X-Key: {value} {other}"), "header"),
        (lambda: spec.parse_injection("query"), "query_param"),
        (lambda: spec.parse_injection("bearer", "X: {value}"), "header"),
        (lambda: spec.parse_injection("smoke-signal"), "method"),
        (lambda: spec.validate_value("no-colon", spec.parse_injection("basic")), "value"),
        (lambda: spec.validate_value("a\r\nX-Evil: 1", spec.parse_injection(None)), "value"),
        (lambda: spec.validate_value("", spec.parse_injection(None)), "value"),
        (lambda: spec.validate_rate(0), "rate_per_minute"),
        (lambda: spec.validate_rate(True), "rate_per_minute"),
        (lambda: spec.validate_expiry(datetime(2020, 1, 1, tzinfo=UTC), datetime.now(UTC)), "expires_at"),
        (lambda: spec.validate_expiry(datetime(2099, 1, 1), datetime.now(UTC)), "expires_at"),
        (lambda: spec.validate_env_var("1X"), "env_var"),
        (lambda: spec.normalize_policy(["ok.example.com", "10.0.0.1/33"], []), "egress.allow[1]"),
        (lambda: spec.normalize_policy([], ["bad host"]), "egress.deny[0]"),
    ],
)
def test_validation_errors_name_the_field(call: object, field: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        call()  # type: ignore[operator]
    assert caught.value.details.get("field") == field, caught.value.message


def test_hosts_and_policies_are_normalized_like_the_gateway_does() -> None:
    hosts = ["API.Example.COM.", "*.Example.com", "api.example.com"]
    assert spec.normalize_hosts(hosts) == ["api.example.com", "*.example.com"]
    assert spec.normalize_hosts(["bücher.example"]) == ["xn--bcher-kva.example"]
    for address in ("[::1]", "0x7f.1", "10.0.0.1", "2130706433"):  # every notation is an address: refused
        with pytest.raises(errors.InvalidArgument):
            spec.normalize_hosts([address])
    allow, deny = spec.normalize_policy(
        ["Example.com", "10.1.2.3", "*.example.org"], ["192.168.0.0/16"], approved=["10.1.0.0/16"]
    )  # a private address only inside what an org admin approved for the project (ADR 0026)
    assert allow == ["example.com", "10.1.2.3/32", "*.example.org"] and deny == ["192.168.0.0/16"]
    # What the control plane stores, the gateway accepts as it is.
    from space.node.egress.credentials import Credential

    made = Credential(name="x", value="v" * 20, hosts=spec.normalize_hosts(hosts))
    assert made.hosts == ["api.example.com", "*.example.com"]


def test_injection_rendering() -> None:
    assert spec.parse_injection(None).render("v") == ("Authorization", "Bearer v")
    assert spec.parse_injection("basic").render("u:p") == ("Authorization", "Basic dTpw")
    assert spec.parse_injection(None, "X-Api-Key: key={value}").render("v") == ("X-Api-Key", "key=v")
    assert spec.parse_injection(None, None, "api_key").render("v") == ("api_key", "v")


# -- audit and node hand-out ---------------------------------------------------------------------------------
def test_every_change_is_audited(service: CredentialService, tenancy: dict[str, str]) -> None:
    t = tenancy
    one, two = canary(), canary()
    put(service, t["org"], "k", one, project=t["p1"])
    put(service, t["org"], "k", two, project=t["p1"])
    service.put(
        org_id=t["org"], project_id=t["p1"], sandbox_id=None, scope="project", name="k",
        fields=CredentialFields(rate_per_minute=30), value=None, actor="key:other",
    )  # fmt: skip
    service.delete(t["p1"], "k", actor="key:test")
    entries = service.credentials.list_audit(
        t["org"], "k", scope="project", scope_id=t["p1"], project_id=None
    )
    assert [(e.action, e.actor) for e in entries] == [
        ("create", "key:test"), ("rotate", "key:test"), ("update", "key:other"), ("delete", "key:test"),
    ]  # fmt: skip
    assert entries[2].detail["rate_per_minute"] == 30
    assert all(one not in str(e) and two not in str(e) for e in entries)


def test_node_bundle_hands_out_bound_unexpired_values_and_audits(
    service: CredentialService, store: Store, tenancy: dict[str, str], clock: Clock
) -> None:
    t = tenancy
    put(service, t["org"], "live", "live-value", project=t["p1"], rate=12)
    put(service, t["org"], "soon", "soon-value", project=t["p1"], expires_at=clock.now + timedelta(minutes=1))
    put(service, t["org"], "unbound", "unbound-value", project=t["p1"])
    service.credentials.put_egress(t["s1"], t["p1"], allow=["api.example.com"], deny=[],
                                   credentials=["live", "soon", "gone"])  # fmt: skip
    sandbox = store.load_sandbox(t["s1"])
    assert isinstance(sandbox, SandboxRecord)
    handed = service.bundle_for_node("node-x", sandbox, t["org"])
    assert "live-value" not in repr(handed)  # a logged bundle shows no value
    bundle = handed.to_wire()
    assert {c["name"]: c["value"] for c in bundle["credentials"]} == {
        "live": "live-value",
        "soon": "soon-value",
    }
    assert bundle["missing"] == ["gone"] and bundle["policy"]["allow"] == ["api.example.com"]
    assert next(c for c in bundle["credentials"] if c["name"] == "live")["rate_per_minute"] == 12
    clock.now += timedelta(minutes=2)
    later = service.bundle_for_node("node-x", sandbox, t["org"]).to_wire()
    assert [c["name"] for c in later["credentials"]] == ["live"] and later["expired"] == ["soon"]
    actions = [
        e.action
        for e in service.credentials.list_audit(
            t["org"], "soon", scope="project", scope_id=t["p1"], project_id=None
        )
    ]
    assert actions == ["create", "fetched_by_node", "expired"]
    fetched = service.credentials.list_audit(
        t["org"], "live", scope="project", scope_id=t["p1"], project_id=None
    )
    assert [e.actor for e in fetched if e.action == "fetched_by_node"] == ["node:node-x", "node:node-x"]


def test_credential_store_egress_versions(store: Store, tenancy: dict[str, str]) -> None:
    creds = CredentialStore(store)
    first = creds.put_egress(tenancy["s1"], tenancy["p1"], allow=["a.example"], deny=None, credentials=None)
    second = creds.put_egress(tenancy["s1"], tenancy["p1"], allow=None, deny=["b.example"], credentials=["x"])
    assert (first.version, second.version) == (1, 2)
    assert (second.allow, second.deny, second.credentials) == (["a.example"], ["b.example"], ["x"])
    with pytest.raises(errors.NotFound):  # another project cannot touch it
        creds.put_egress(tenancy["s1"], tenancy["p2"], allow=[], deny=None, credentials=None)


def test_purge_removes_values_nobody_references_and_credentials_of_deleted_sandboxes(
    service: CredentialService, store: Store, tenancy: dict[str, str], clock: Clock
) -> None:
    t = tenancy
    put(service, t["org"], "sbcred", "v1", scope="sandbox", project=t["p1"], sandbox=t["s1"])
    put(service, t["org"], "kept", "v2", scope="sandbox", project=t["p1"], sandbox=t["s2"])
    orphan = service.vault.put("crashed-put", b"left behind")  # as if the process died before the row
    assert service.purge()["values"] == 0  # too young: it may be a put in flight
    clock.now += timedelta(hours=1)
    sb = store.load_sandbox(t["s1"])
    assert sb is not None
    sb = store.transition(sb.id, sb.state, sb.generation, "delete")
    store.transition(sb.id, sb.state, sb.generation, "deleted")
    assert service.purge() == {"credentials": 1, "values": 1}
    with pytest.raises(errors.NotFound):
        service.vault.get(orphan)
    assert service.credentials.get_credential(t["s1"], "sbcred") is None
    assert service.credentials.get_credential(t["s2"], "kept") is not None
    log = service.credentials.list_audit(
        t["org"], "sbcred", scope="sandbox", scope_id=t["s1"], project_id=None
    )
    assert [(e.action, e.actor) for e in log][-1] == ("delete", "system:sandbox-deleted")
    assert service.credentials.unreferenced_blobs() == []
    assert service.purge() == {"credentials": 0, "values": 0}


def test_concurrent_starters_agree_on_one_master_key(tmp_path: pathlib.Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / MASTER_KEY_FILENAME
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _i: load_master_key(path), range(32)))
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert [p.name for p in tmp_path.iterdir()] == [MASTER_KEY_FILENAME]  # no temporary file left
