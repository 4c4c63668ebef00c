"""The one error model of every HTTP surface (space.rest.errors): statuses, body shape, validation shape."""

from __future__ import annotations

import pathlib
import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from space.core import errors
from space.rest import errors as rest_errors


def _every_error_class() -> list[type[errors.SpaceError]]:
    """The classes of the hierarchy (space.core.errors); a client's own errors (the SDK's transport and
    configuration errors) never cross an HTTP surface and are not in the map."""
    found: list[type[errors.SpaceError]] = []
    pending = [errors.SpaceError]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub.__module__ == errors.__name__:
                found.append(sub)
            pending.append(sub)
    return found


@pytest.mark.parametrize("cls", _every_error_class(), ids=lambda cls: cls.__name__)
def test_every_error_class_has_a_status_of_its_own(cls: type[errors.SpaceError]) -> None:
    # A new class must be placed in the map on purpose, not fall through to 500 by accident.
    assert cls.code in rest_errors.STATUS_BY_CODE, cls.code


def test_codes_that_once_disagreed_between_surfaces_have_one_status() -> None:
    status = {code: rest_errors.STATUS_BY_CODE[code] for code in
              ("resource_exhausted", "guest_error", "runtime_failure", "storage_exhausted")}  # fmt: skip
    assert status == {
        "resource_exhausted": 429,
        "guest_error": 502,
        "runtime_failure": 502,
        "storage_exhausted": 507,
    }


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int


def _app() -> FastAPI:
    app = FastAPI()
    rest_errors.install(app, surface="test surface")

    @app.post("/things")
    async def make(body: _Body) -> dict[str, int]:
        return {"size": body.size}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals /etc/passwd")

    @app.get("/slow")
    async def slow() -> None:
        raise errors.ResourceExhausted("slow down", retry_after_s=1.2)

    @app.get("/who")
    async def who() -> None:
        raise errors.Unauthenticated("no key")

    return app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(_app(), raise_server_exceptions=False)


def test_a_malformed_body_names_each_field_and_problem(client: TestClient) -> None:
    answer = client.post("/things", json={"size": "big", "extra": 1})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "validation_error"
    assert set(error["details"]["fields"]) == {"size", "extra"}
    assert {p["field"] for p in error["details"]["errors"]} == {"size", "extra"}
    rebuilt = errors.error_from_dict(answer.json()["error"])
    assert isinstance(rebuilt, errors.RequestInvalid) and isinstance(rebuilt, errors.InvalidArgument)


def test_an_unexpected_failure_is_500_naming_no_internals(client: TestClient) -> None:
    answer = client.get("/boom")
    assert answer.status_code == 500
    assert answer.json() == {
        "error": {"code": "internal", "message": "internal error in the test surface", "details": {}}
    }


def test_rate_limits_say_when_to_retry_and_401s_name_the_scheme(client: TestClient) -> None:
    slow = client.get("/slow")
    assert (slow.status_code, slow.headers["retry-after"]) == (429, "2")
    who = client.get("/who")
    assert (who.status_code, who.headers["www-authenticate"]) == (401, "Bearer")


def test_routing_failures_have_the_same_shape(client: TestClient) -> None:
    missing = client.get("/nowhere")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    wrong = client.delete("/things")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")


def test_the_documented_status_table_is_the_map() -> None:
    api_md = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"
    documented: dict[str, int] = {}
    for codes, status in re.findall(r"^\| ([a-z_ /]+) \| (\d{3}) \|", api_md.read_text(), re.MULTILINE):
        for code in codes.split(" / "):
            documented[code.strip()] = int(status)
    assert documented == rest_errors.STATUS_BY_CODE
