"""Fixtures for end-to-end tests: a started KVCM server inside a Harness, always closed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.harness import Harness


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    await harness.start_server()
    yield harness
    await harness.close()
