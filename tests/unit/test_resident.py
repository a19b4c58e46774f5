"""The hook's array-backed resident set against a dict model (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hook import resident
from engine_hook.resident import ResidentSet
from sidecar.shm_ring import layout as L
from tests.oracle import fold_mediums

# Over KeyIndex's C probe and its numpy fallback (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")

OPS = st.lists(
    st.tuples(
        st.sampled_from([L.KIND_STORED] * 6 + [L.KIND_REMOVED] * 4 + [L.KIND_CLEARED]),
        st.integers(0, 3),
        st.sampled_from([0, 0, 0, 1, 2]),
        st.integers(-(2**63), 2**63 - 1) | st.integers(-50, 50),
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    chunk=st.integers(1, 50),
    fold_at=st.sampled_from([1, 7, 1 << 16]),
    step=st.integers(1, 4),
)
def test_resident_set_equals_fold_of_all_ops(
    ops: list[tuple[int, int, int, int]], chunk: int, fold_at: int, step: int
) -> None:
    from sidecar.shm_ring import key_table

    old = resident.FOLD_AT, key_table.REBUILD_STEP
    resident.FOLD_AT, key_table.REBUILD_STEP = fold_at, step  # re-indexes span many folds
    try:
        rs = ResidentSet(capacity=16)  # tiny: forces growth and rebuilds
        for i in range(0, len(ops), chunk):
            part = ops[i : i + chunk]
            keys = np.array([k for *_, k in part], np.int64)
            metas = np.array([L.pack_meta(kind, g, m) for kind, g, m, _ in part], np.uint64)
            rs.apply(keys, metas)
        assert rs.as_dict() == fold_mediums(ops)
        assert len(rs) == len(fold_mediums(ops))  # as_dict() folded everything queued
    finally:
        resident.FOLD_AT, key_table.REBUILD_STEP = old


def test_resident_set_churn_keeps_table_bounded() -> None:
    rs = ResidentSet()
    caps = []
    for base in range(0, 2_000_000, 20_000):
        keys = np.arange(base, base + 20_000, dtype=np.int64)
        rs.apply(keys, np.full(len(keys), L.pack_meta(L.KIND_STORED), np.uint64))
        rs.apply(keys - 20_000, np.full(len(keys), L.pack_meta(L.KIND_REMOVED), np.uint64))
        caps.append(rs._cap)
    assert len(rs.as_dict()) == 20_000
    # 2 M distinct keys went through; removed ones are compacted away, so the table stays small.
    assert max(caps) <= 1 << 20
