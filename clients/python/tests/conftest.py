"""Fixtures over the real stack of ``stack.py``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest

from idem_client import Idem
from stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.close()


@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack for one test that stops, kills or restarts its relay."""
    s = Stack(tmp_path)
    yield s
    s.close()


@pytest.fixture(scope="module")
def idem(stack: Stack) -> Iterator[Idem]:
    with stack.client() as client:
        yield client


@pytest.fixture
def run_id() -> str:
    return f"run_{uuid.uuid4().hex[:10]}"
