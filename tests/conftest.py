"""Shared fixtures: unique shm names that are always unlinked, the engine helper process."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings

from sidecar.shm_ring.segment import unlink

# No per-example deadline: it asserts wall-clock speed, and on a shared 2-vCPU machine an example
# that takes 0.3 ms alone can take 300 ms beside other suites (hypothesis then calls it flaky).
settings.register_profile("kvcm", deadline=None)
settings.load_profile("kvcm")


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = f"/kvcm-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield name
    unlink(name)


@pytest.fixture(scope="module", params=["c", "numpy"])
def accel_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module's tests over the C hot loops (sidecar/shm_ring/_accel.c) and over their
    numpy / Python forms (what an install without a C compiler runs). Module-scoped: hypothesis
    tests may use it."""
    from sidecar.shm_ring import compiled

    built = compiled.accel
    if request.param == "c" and built is None:
        pytest.skip("the C loops were not built (no compiler at install)")
    compiled.accel = built if request.param == "c" else None
    try:
        yield request.param
    finally:
        compiled.accel = built


@pytest.fixture(scope="session", autouse=True)
def identity_lock_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Sidecars started by tests (in process, or as children inheriting the environment) keep
    their one-per-identity flock files in a temporary directory, not /dev/shm: the files stay
    after the process by design (unlinking a flock file races its next owner), and each test
    reports under an identity of its own, so /dev/shm collected one file per test run."""
    path = str(tmp_path_factory.mktemp("identity-locks"))
    key = "KV_CACHE_EVENT_IDENTITY_LOCK_DIR"
    old = os.environ.get(key)
    os.environ[key] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
