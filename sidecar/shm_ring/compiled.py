"""The hot loops in C (_accel.c), or None when the install had no C compiler.

Imports: stdlib only. Callers read `compiled.accel` at each call, not at import, so the tests
(tests/conftest.py, `accel_backend`) can run the numpy / Python forms, which stay as the
reference and the fallback, by setting it to None.
"""

from __future__ import annotations

from types import ModuleType

accel: ModuleType | None
try:
    from sidecar.shm_ring import _accel as accel
except ImportError:  # setup.py builds it optional
    accel = None
