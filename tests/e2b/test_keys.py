"""API keys in E2B's shape (`e2b_` + hex, which E2B's older SDKs check client-side): minted by the store
like any key, authenticated and revoked like any key, and refused when only the prefix is right."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from space.controlplane.store.migrate import migrate
from space.controlplane.store.store import Store
from space.core import errors

E2B_SHAPE = re.compile(r"\Ae2b_[0-9a-f]+\Z")  # the check of E2B's SDK 2.45 (e2b/api/__init__.py)


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    migrate(url)
    made = Store(url)
    yield made
    made.close()


def test_e2b_shaped_keys_are_ordinary_keys(store: Store) -> None:
    org = store.create_org("o")
    project = store.create_project(org.id, "p")
    record, secret = store.create_api_key(project.id, org.id, "read-only", shape="e2b")
    assert E2B_SHAPE.match(secret) and len(secret) == 4 + 60
    assert record.prefix == secret[:12] and record.role == "read-only"
    found = store.authenticate(secret)
    assert found is not None and found.id == record.id and found.project_id == project.id
    _other, space_secret = store.create_api_key(project.id, org.id, "member")
    assert space_secret.startswith("space_") and store.authenticate(space_secret) is not None
    # The prefix alone is nothing: a forged or altered key does not authenticate.
    for forged in (
        "e2b_",
        "e2b_" + "0" * 60,
        secret[:-1] + ("0" if secret[-1] != "0" else "1"),
        secret.upper(),
    ):
        assert store.authenticate(forged) is None, forged
    store.revoke_key(record.id)
    assert store.authenticate(secret) is None
    with pytest.raises(errors.InvalidArgument):
        store.create_api_key(project.id, org.id, "member", shape="aws")  # type: ignore[arg-type]
