"""hash_arrays.read_keys: msgpack block-hash arrays read in place == decoded one by one."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.source.hash_arrays import fold_hashes, read_keys

RAWS = msgspec.msgpack.Decoder(list[msgspec.Raw])
ONE = msgspec.msgpack.Decoder(list[int | bytes])
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


def one_by_one(arrays: list[bytes]) -> tuple[list[int], list[int], list[int]]:
    """The reference: each msgpack array decoded by msgspec as list[int | bytes], folded."""
    keys: list[int] = []
    counts: list[int] = []
    bad: list[int] = []
    for i, r in enumerate(arrays):
        try:
            hashes = ONE.decode(r)
        except msgspec.ValidationError:
            bad.append(i)
            counts.append(0)
            continue
        keys += fold_hashes(hashes).tolist()
        counts.append(len(hashes))
    return keys, counts, bad


@settings(max_examples=400, deadline=None)
@given(arrays=st.lists(st.one_of(GOOD, GOOD, GOOD, BAD), max_size=30))
def test_hash_arrays_read_in_place_equal_the_one_by_one_fold(arrays: list[Any]) -> None:
    raws = RAWS.decode(msgspec.msgpack.encode(arrays))
    keys, counts, bad = read_keys(raws)
    assert (keys.tolist(), counts.tolist(), bad) == one_by_one(
        [msgspec.msgpack.encode(a) for a in arrays]
    )


def test_hash_arrays_ints_keep_their_low_64_bits_and_digests_their_last_8_bytes() -> None:
    digest = bytes(range(32))
    raws = RAWS.decode(msgspec.msgpack.encode([[2**64 - 1, -1, 2**63], [digest] * 17, []]))
    keys, counts, bad = read_keys(raws)
    last8 = int.from_bytes(digest[24:], "big")
    assert keys.tolist() == [-1, -1, -(2**63)] + [last8] * 17
    assert counts.tolist() == [3, 17, 0] and bad == []


def _array(header: str, items: list[bytes]) -> bytes:
    n = len(items)
    head = {
        "fix": bytes([0x90 | n]) if n < 16 else None,
        "16": b"\xdc" + n.to_bytes(2, "big"),
        "32": b"\xdd" + n.to_bytes(4, "big"),
    }[header]
    assert head is not None
    return head + b"".join(items)


ELEMENT = st.one_of(
    st.integers(0, 2**64 - 1).map(lambda v: b"\xcf" + v.to_bytes(8, "big")),  # even small
    st.integers(-(2**63), 2**63 - 1).map(lambda v: b"\xd3" + v.to_bytes(8, "big", signed=True)),
    st.integers(0, 2**32 - 1).map(lambda v: b"\xce" + v.to_bytes(4, "big")),
    st.integers(0, 127).map(lambda v: bytes([v])),
    st.binary(min_size=32, max_size=32).map(lambda d: b"\xc4\x20" + d),
    st.binary(min_size=32, max_size=32).map(lambda d: b"\xc5\x00\x20" + d),  # bin16
    st.binary(max_size=40).map(lambda d: b"\xc6" + len(d).to_bytes(4, "big") + d),  # bin32
    st.binary(min_size=8, max_size=8).map(lambda d: b"\xcb" + d),  # a float64: 9 bytes too
    st.binary(min_size=8, max_size=8).map(lambda d: b"\xd7\x01" + d),  # fixext8
    st.binary(min_size=32, max_size=32).map(lambda d: b"\xc7\x20\x01" + d),  # ext8: 35 bytes
    st.just(b"\xc0"),  # nil
)
ARRAY = st.tuples(st.sampled_from(["fix", "16", "32"]), st.lists(ELEMENT, max_size=15))


@settings(max_examples=400, deadline=None)
@given(arrays=st.lists(ARRAY, max_size=12), fast=st.lists(st.integers(2**32, 2**63), max_size=20))
def test_hash_arrays_any_encoding_reads_as_msgspec_decodes_it(
    arrays: list[tuple[str, list[bytes]]], fast: list[int]
) -> None:
    # Non-minimal encodings (array16/32 of a few, small values as uint64, bin16/32), same-size
    # elements that are no hashes (a float64, ext), and a fast array broken by its last element.
    raw = [_array(h, items) for h, items in arrays]
    raw.append(
        _array(
            "fix" if len(fast) < 15 else "16",
            [b"\xcf" + v.to_bytes(8, "big") for v in fast] + [b"\xcb" + bytes(8)],
        )
    )
    raw.append(_array("16", [b"\xcf" + v.to_bytes(8, "big") for v in fast]))
    body = _array("32", raw)  # the batch: a list of the arrays, decoded as Raw each
    keys, counts, bad = read_keys(RAWS.decode(body))
    assert (keys.tolist(), counts.tolist(), bad) == one_by_one(raw)


def test_hash_arrays_long_arrays_at_the_header_boundaries() -> None:
    for n in (15, 16, 65535, 65536):
        ints = [2**63 + i for i in range(n)]
        digests = [i.to_bytes(32, "big") for i in range(n)]
        body = msgspec.msgpack.encode([ints, digests, [*ints[:-1], 7]])
        keys, counts, bad = read_keys(RAWS.decode(body))
        want = fold_hashes(ints).tolist() + list(range(n)) + fold_hashes([*ints[:-1], 7]).tolist()
        assert keys.tolist() == want and counts.tolist() == [n, n, n] and bad == []
