"""hash_arrays.read_keys: msgpack block-hash arrays read in place == decoded one by one."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.source.hash_arrays import fold_hashes, read_keys

RAWS = msgspec.msgpack.Decoder(list[msgspec.Raw])
BIG = st.one_of(st.integers(2**32, 2**64 - 1), st.integers(-(2**63), -(2**31) - 1))  # 9 bytes
HASH = st.one_of(
    BIG,
    BIG,
    st.binary(min_size=32, max_size=32),
    st.integers(-(2**31), 2**32 - 1),  # shorter encodings: read one by one
    st.binary(max_size=40),
)
GOOD = st.one_of(
    st.lists(BIG, max_size=40),  # fixarray and array16, every element 9 bytes
    st.lists(st.binary(min_size=32, max_size=32), max_size=20),
    st.lists(HASH, max_size=20),
)
BAD = st.one_of(
    st.text(max_size=8),
    st.floats(allow_nan=False),
    st.none(),
    st.lists(st.one_of(st.text(min_size=8, max_size=8), st.floats()), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 3)), min_size=1, max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(arrays=st.lists(st.one_of(GOOD, GOOD, GOOD, BAD), max_size=30))
def test_hash_arrays_read_in_place_equal_the_one_by_one_fold(arrays: list[Any]) -> None:
    raws = RAWS.decode(msgspec.msgpack.encode(arrays))
    keys, counts, bad = read_keys(raws)
    want: list[int] = []
    want_bad: list[int] = []
    want_counts: list[int] = []
    for i, a in enumerate(arrays):
        ok = isinstance(a, list) and all(
            isinstance(h, bytes) or (isinstance(h, int) and not isinstance(h, bool)) for h in a
        )
        if not ok:
            want_bad.append(i)
            want_counts.append(0)
            continue
        want += fold_hashes(a).tolist()
        want_counts.append(len(a))
    assert keys.tolist() == want
    assert counts.tolist() == want_counts
    assert bad == want_bad


def test_hash_arrays_ints_keep_their_low_64_bits_and_digests_their_last_8_bytes() -> None:
    digest = bytes(range(32))
    raws = RAWS.decode(msgspec.msgpack.encode([[2**64 - 1, -1, 2**63], [digest] * 17, []]))
    keys, counts, bad = read_keys(raws)
    last8 = int.from_bytes(digest[24:], "big")
    assert keys.tolist() == [-1, -1, -(2**63)] + [last8] * 17
    assert counts.tolist() == [3, 17, 0] and bad == []
