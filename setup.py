"""The one compiled part: sidecar/shm_ring/_accel.c (KeyIndex's probe loop, the resident fold),
with _rekey.c (the rolling key table, issue #22), _wire.c (a delta request's body) and _bits.c
(a key-state tier's group bits at known positions) compiled into the same module.

Everything else is in pyproject.toml. `optional=True`: without a C compiler or Python's headers
the install still succeeds and the numpy probes in key_index.py / resident.py run instead
(`sidecar.shm_ring.compiled.accel` is None then; docs/operations.md, "Prerequisites").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar.shm_ring._accel",
            [
                "sidecar/shm_ring/_accel.c",
                "sidecar/shm_ring/_rekey.c",
                "sidecar/shm_ring/_wire.c",
                "sidecar/shm_ring/_bits.c",
            ],
            depends=["sidecar/shm_ring/rolling.h", "sidecar/shm_ring/digits.h"],
            optional=True,
        ),
    ]
)
