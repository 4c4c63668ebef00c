"""Fixtures for node-agent tests over the fake driver (no root). A test module binds them by importing
them (`from tests.support.fake_agent import agent, loop`): `loop` is then a fresh BackgroundLoop per test
in that module (instead of the session loop of tests/conftest.py), and `agent` a prepared NodeAgent over
a FakeDriver in the test's tmp_path, with every sandbox deleted and the agent closed afterwards."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from space.node.agent.agent import NodeAgent
from space.node.drivers.fake import FakeDriver
from tests.support.loop import BackgroundLoop


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop()
    yield background
    background.close()


@pytest.fixture
def agent(loop: BackgroundLoop, tmp_path: pathlib.Path) -> Iterator[NodeAgent]:
    node = NodeAgent(FakeDriver(tmp_path))
    loop.run(node.prepare())
    yield node
    loop.run(node.delete_all())
    loop.run(node.close())
