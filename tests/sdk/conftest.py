"""Fixtures of the SDK and CLI tests. `server`: the fake API server behind the `space` command
(tests/support/sdk_server.py), under the name the CLI tests use."""

from __future__ import annotations

import pytest

from tests.support import sdk_server
from tests.support.sdk_server import FakeServer

cli_server = sdk_server.cli_server


@pytest.fixture
def server(cli_server: FakeServer) -> FakeServer:
    return cli_server
