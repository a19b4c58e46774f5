"""KeyIndex: bulk inserts of absent keys land where lookups (linear probing) find them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.shm_ring import key_index
from sidecar.shm_ring.key_index import KeyIndex, sized_for
from sidecar.shm_ring.key_table import KeyTable

# Over KeyIndex's C probe and its numpy fallback (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")

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


@pytest.mark.parametrize("tail", [0, 1, 3, 8, 1 << 30], ids=lambda t: f"tail{t}")
@given(
    pre=st.lists(st.integers(-30, 30), unique=True, max_size=40),
    keys=st.lists(st.integers(-30, 30), max_size=200),
    cap=st.sampled_from([8, 64, 128]),
)
def test_key_index_find_gives_every_copy_of_a_key_its_one_position(
    tail: int, pre: list[int], keys: list[int], cap: int
) -> None:
    # Few distinct keys (negatives too) in small tables, some smaller than a probe window:
    # copies of one key contend for its empty slot in the same round, runs wrap past the end,
    # and the probing switches from a round per slot to windows in the middle of a call.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(key_index, "_TAIL", tail)
        while (len(set(pre) | set(keys)) + 1) * 10 > cap * 7:
            cap *= 2
        idx = KeyIndex(cap)
        first = idx.find(np.array(pre, np.int64)).tolist()
        assert sorted(first) == list(range(len(pre)))  # n, n+1, ... (in claim order)
        pos_of: dict[int, int] = dict(zip(pre, first, strict=True))
        lookup = idx.find(np.array(keys, np.int64), insert=False).tolist()
        assert lookup == [pos_of.get(k, -1) for k in keys]
        got = idx.find(np.array(keys, np.int64)).tolist()
        for k, p in zip(keys, got, strict=True):
            assert pos_of.setdefault(k, p) == p  # old keys keep theirs, copies agree
        assert sorted(pos_of.values()) == list(range(len(pos_of)))
        assert idx.n == len(pos_of)
        assert (idx._tpos >= 0).all()  # no claim mark left behind
        assert int((idx._tpos > 0).sum()) == len(pos_of)  # each key in one slot
        both = sorted(pos_of)
        found = idx.find(np.array(both, np.int64), insert=False).tolist()
        assert found == [pos_of[k] for k in both]
        absent = np.array([k for k in range(31, 60)], np.int64)
        assert (idx.find(absent, insert=False) == -1).all()


def test_key_index_full_raises_instead_of_probing_forever() -> None:
    idx = KeyIndex(8)
    idx.insert_absent(np.arange(8, dtype=np.int64))
    for insert in (True, False):
        with pytest.raises(key_index.IndexFull):
            idx.find(np.array([99], np.int64), insert=insert)


def test_key_table_reindexes_in_time_for_keys_a_hash_estimate_would_undercount() -> None:
    # Review of #16: the re-index was paced by a linear-counting estimate hashed with the
    # index's own multiplier; keys that are multiples of it (a Fibonacci-hashing engine's)
    # all landed in a few bits, the estimate said ~12 k for 150 k, no re-index started, and the
    # insert probed a full index forever (inside the engine's flush).
    table = KeyTable({"masks": np.uint32}, live=("masks",), min_capacity=1 << 16)
    golden = np.uint64(0x9E3779B97F4A7C15)
    keys = (np.arange(1, 150_001, dtype=np.uint64) * golden).view(np.int64)
    done: list[np.ndarray] = []
    worker = threading.Thread(target=lambda: done.append(table.find(keys)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done, "find never returned"
    assert len(np.unique(done[0])) == 150_000 and table.n == 150_000
