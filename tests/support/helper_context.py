"""`ctx`: a root helper context for tests that call helper verbs in process without root: a fresh node
layout in the test's tmp_path, owned by the current user, and a runsc binary that does not exist, so any
verb that got past validation and tried to run a sandbox would fail loudly. A test module binds it by
importing it (`from tests.support.helper_context import ctx`)."""

from __future__ import annotations

import os
import pathlib

import pytest

from space.node.helper.context import HelperContext
from space.node.helper.runsc import Runsc
from space.node.layout import NodeLayout


@pytest.fixture
def ctx(tmp_path: pathlib.Path) -> HelperContext:
    layout = NodeLayout(tmp_path / "data")
    layout.data_dir.mkdir()
    return HelperContext(
        layout=layout, runsc=Runsc(root=layout.runsc_root, binary="/nonexistent/runsc"), owner_uid=os.getuid()
    )
