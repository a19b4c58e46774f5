"""KeyIndex: bulk inserts of absent keys land where lookups (linear probing) find them."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sidecar.shm_ring.key_index import KeyIndex, sized_for

KEYS = st.lists(st.integers(-(2**63), 2**63 - 1), unique=True, max_size=200)


@given(keys=KEYS, extra=KEYS, small=st.booleans())
def test_key_index_insert_absent_finds_every_key_in_order_and_only_those(
    keys: list[int], extra: list[int], small: bool
) -> None:
    # A tight table (down to 70 % full) makes runs long and wrap past the end.
    cap = sized_for(len(keys), 4) if small else sized_for(len(keys), 1024)
    while len(keys) * 10 > cap * 7:
        cap *= 2
    idx = KeyIndex(cap)
    half = len(keys) // 2  # in two calls, as a rebuild does chunk by chunk
    idx.insert_absent(np.array(keys[:half], np.int64))
    idx.insert_absent(np.array(keys[half:], np.int64))
    assert idx.find(np.array(keys, np.int64), insert=False).tolist() == list(range(len(keys)))
    absent = np.array([k for k in extra if k not in set(keys)], np.int64)
    assert (idx.find(absent, insert=False) == -1).all()
    # Later inserts probe through those runs like through any other.
    if not idx.crowded(len(absent)):
        got = idx.find(absent)
        assert sorted(got.tolist()) == list(range(len(keys), len(keys) + len(absent)))
        both = np.concatenate([np.array(keys, np.int64), absent])
        assert idx.find(both, insert=False).tolist() == list(range(len(keys))) + got.tolist()


def test_key_index_insert_absent_wraps_a_run_past_the_table_end() -> None:
    probe = KeyIndex(16)
    keys = [k for k in range(10_000) if probe._home(np.array([k], np.int64))[0] == 15][:3]
    idx = KeyIndex(16)
    idx.insert_absent(np.array(keys, np.int64))
    assert idx.find(np.array(keys, np.int64), insert=False).tolist() == [0, 1, 2]
    assert sorted(idx._tpos[[15, 0, 1]].tolist()) == [1, 2, 3]  # 15, then wrapped to 0 and 1
