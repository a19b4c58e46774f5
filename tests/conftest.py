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


@pytest.fixture(scope="module", params=["c", "numpy"])
def probe_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests over KeyIndex's C probe (_probe.c) and over its numpy fallback
    (what an install without a C compiler runs). Module-scoped: hypothesis tests may use it."""
    from sidecar.shm_ring import key_index

    built = key_index._probe
    if request.param == "c" and built is None:
        pytest.skip("the C probe was not built (no compiler at install)")
    key_index._probe = built if request.param == "c" else None
    try:
        yield request.param
    finally:
        key_index._probe = built
