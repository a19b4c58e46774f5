"""_accel.c, the hot loops in C (KeyIndex's probe, the resident fold, the ring write), against
the numpy / Python forms they replace."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.shm_ring import compiled, key_index
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.key_index import IndexFull, KeyIndex

accel = compiled.accel
needs_c = pytest.mark.skipif(accel is None, reason="the C loops were not built")


def test_accel_is_built_wherever_a_compiler_is() -> None:
    # The benchmarks' figures are the C loops': an install that silently fell back to numpy
    # (setup.py builds it optional) must not pass for one that has it.
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    if headers and (shutil.which("gcc") or shutil.which("cc")):
        assert accel is not None


def test_accel_from_another_revision_is_not_used() -> None:
    # A stale in-place build (a pull without a rebuild) would fail every flush on a changed
    # signature: compiled.py uses the numpy / Python forms instead, and says so.
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('sidecar.shm_ring._accel')\n"
        "fake.ABI = -1\n"
        "sys.modules['sidecar.shm_ring._accel'] = fake\n"
        "from sidecar.shm_ring import compiled\n"
        "print(compiled.accel)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
    assert "from another revision" in out.stderr


@needs_c
def test_accel_constants_are_the_ring_layouts() -> None:
    assert accel is not None
    assert (accel.KIND_STORED, accel.KIND_REMOVED) == (L.KIND_STORED, L.KIND_REMOVED)
    assert (accel.W_TAIL, accel.W_LAST_SEQ, accel.W_ATTEMPTED) == (
        L.W_TAIL,
        L.W_LAST_SEQ,
        L.W_ATTEMPTED,
    )
    assert accel.HEADER_WORDS * 8 == L.HEADER_SIZE
    assert (accel.W_HEAD, accel.W_DROPPED, accel.W_READER_LIVENESS_NS, accel.W_INC_GEN) == (
        L.W_HEAD,
        L.W_DROPPED,
        L.W_READER_LIVENESS_NS,
        L.W_INC_GEN,
    )


def _both(cap: int) -> tuple[KeyIndex, KeyIndex]:
    return KeyIndex(cap), KeyIndex(cap)


@needs_c
@given(
    calls=st.lists(
        st.tuples(st.lists(st.integers(-40, 40), max_size=60), st.booleans()), max_size=8
    ),
    cap=st.sampled_from([128, 256]),
)
def test_accel_find_agrees_with_numpy_rounds(calls: list[tuple[list[int], bool]], cap: int) -> None:
    # The same calls on two indexes, C and numpy: the same keys end up in, each key's copies
    # get one position, lookups agree once positions are mapped by key, and the C form gives
    # new keys n, n+1, ... in first-seen order.
    c_idx, np_idx = _both(cap)
    for keys, insert in calls:
        arr = np.array(keys, np.int64)
        n0 = c_idx.n
        got_c = c_idx.find(arr, insert=insert)
        compiled.accel = None
        try:
            got_np = np_idx.find(arr, insert=insert)
        finally:
            compiled.accel = accel
        assert c_idx.n == np_idx.n
        c_of = dict(zip(c_idx.keys[: c_idx.n].tolist(), range(c_idx.n), strict=True))
        np_of = dict(zip(np_idx.keys[: np_idx.n].tolist(), range(np_idx.n), strict=True))
        assert c_of.keys() == np_of.keys()
        assert got_c.tolist() == [c_of.get(k, -1) for k in keys]
        assert got_np.tolist() == [np_of.get(k, -1) for k in keys]
        new = [k for k in dict.fromkeys(keys) if c_of.get(k, -1) >= n0]
        assert [c_of[k] for k in new] == list(range(n0, c_idx.n))
    assert (c_idx._tpos > 0).sum() == c_idx.n  # each key in one slot


@needs_c
def test_accel_full_index_raises_with_the_keys_before_it_kept() -> None:
    idx = KeyIndex(8)
    idx.find(np.arange(6, dtype=np.int64))
    with pytest.raises(IndexFull):
        idx.find(np.array([100, 101, 102, 103], np.int64))
    assert idx.n == 8  # two fitted before the index was full
    assert idx.find(np.array([100, 101], np.int64), insert=False).tolist() == [6, 7]
    with pytest.raises(IndexFull):
        idx.find(np.array([555], np.int64), insert=False)  # every slot probed, not found


@needs_c
def test_accel_rejects_arrays_that_do_not_fit() -> None:
    assert accel is not None
    idx = KeyIndex(16)
    keys = np.arange(4, dtype=np.int64)
    out = np.empty(4, np.int64)
    with pytest.raises(TypeError, match="keys"):
        accel.find(keys.astype(np.int32), idx._tkeys, idx._tpos, idx.keys, out, 0, True)
    with pytest.raises(ValueError, match="do not fit"):
        accel.find(keys, idx._tkeys, idx._tpos, idx.keys[:2], out, 0, True)  # no room
    with pytest.raises(ValueError, match="do not fit"):
        accel.find(keys, idx._tkeys[:12], idx._tpos[:12], idx.keys, out, 0, True)  # not 2^k
    masks = np.zeros(4, np.uint32)
    with pytest.raises(IndexError):
        accel.apply(np.array([4], np.int64), np.array([1], np.uint64), masks)
    with pytest.raises(TypeError, match="masks"):
        accel.apply(np.array([0], np.int64), np.array([1], np.uint64), masks.astype(np.int64))
    with pytest.raises(ValueError, match="length"):
        accel.apply(np.array([0, 1], np.int64), np.array([1], np.uint64), masks)


@needs_c
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 5), st.sampled_from([L.KIND_STORED, L.KIND_REMOVED]), st.integers(0, 33)
        ),
        max_size=80,
    )
)
def test_accel_apply_is_the_records_in_order(ops: list[tuple[int, int, int]]) -> None:
    # Groups past 31 have no bit in a uint32 mask: they change nothing, as the numpy fold's
    # astype(uint32) drops them.
    assert accel is not None
    masks = np.zeros(6, np.uint32)
    want = [0] * 6
    for p, kind, g in ops:
        bit = (1 << g) & 0xFFFFFFFF
        want[p] = want[p] | bit if kind == L.KIND_STORED else want[p] & ~bit
    pos = np.array([p for p, _, _ in ops], np.int64)
    metas = np.array([L.pack_meta(k, g) for _, k, g in ops], np.uint64)
    accel.apply(pos, metas, masks)
    assert masks.tolist() == want


@needs_c
def test_accel_is_built_from_the_current_source() -> None:
    # An in-place build (pip install -e, what scripts/test runs) older than _accel.c is a stale
    # module: the tests would pass or fail for code that is not in the tree.
    assert accel is not None and accel.__file__ is not None
    built = Path(accel.__file__)
    for name in (
        "_accel.c",
        "_rekey.c",
        "_wire.c",
        "_bits.c",
        "rolling.h",
        "digits.h",
    ):  # the module's sources (setup.py)
        src = Path(key_index.__file__).with_name(name)
        if src.is_file() and built.parent == src.parent:
            assert built.stat().st_mtime >= src.stat().st_mtime, f"rebuild {name}: scripts/test"


@needs_c
def test_accel_words_is_the_staging_conversion() -> None:
    assert accel is not None
    from array import array

    got = accel.words([0, 1, 2**64 - 1, -1, -(2**63), 2**63])
    assert type(got) is array and got.typecode == "Q"
    assert list(got) == [0, 1, 2**64 - 1, 2**64 - 1, 2**63, 2**63]
    assert list(accel.words([])) == []
    for bad in ([1, True], [1, "x"], [np.int64(1)], [1.0]):
        with pytest.raises(TypeError):
            accel.words(bad)
    for big in ([2**64], [-(2**63) - 1], [10**30]):
        with pytest.raises(OverflowError):
            accel.words(big)
    with pytest.raises(TypeError):
        accel.words((1, 2))
