"""Fixtures over the real stack of ``stack.py``."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from idem_client import Idem
from stack import Stack, stack_fixtures


stack, own_stack = stack_fixtures()


@pytest.fixture(scope="module")
def idem(stack: Stack) -> Iterator[Idem]:
    with stack.client() as client:
        yield client


@pytest.fixture
def run_id() -> str:
    return f"run_{uuid.uuid4().hex[:10]}"
