"""The hot loops in C (_accel.c), or None when the install had no C compiler.

Imports: stdlib only. Callers read `compiled.accel` at each call, not at import, so the tests
(tests/conftest.py, `accel_backend`) can run the numpy / Python forms, which stay as the
reference and the fallback, by setting it to None.
"""

from __future__ import annotations

import logging
from types import ModuleType

# What this Python code calls _accel.c with: a module built from another revision (an in-place
# build a `git pull` left behind) is not used, or every flush would fail on its signatures.
ACCEL_ABI = 25

accel: ModuleType | None
try:
    from sidecar.shm_ring import _accel as accel
except ImportError:  # setup.py builds it optional
    accel = None
if accel is not None and getattr(accel, "ABI", None) != ACCEL_ABI:
    logging.getLogger(__name__).warning(
        "kvcm: %s is from another revision (ABI %s, want %s): using the numpy / Python forms;"
        " rebuild it (pip install .)",
        getattr(accel, "__file__", accel.__name__),
        getattr(accel, "ABI", None),
        ACCEL_ABI,
    )
    accel = None
