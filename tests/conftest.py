"""Shared fixtures: unique shm names that are always unlinked, the engine helper process."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from sidecar.shm_ring.segment import unlink


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = f"/kvcm-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield name
    unlink(name)
