"""engine_hook: attach, gating, key normalisation, never-raises, bounded staging delay."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import engine_hook
from engine_hook.descriptor import Descriptor, DescriptorError
from engine_hook.hook import Hook, NullHook, normalize_keys
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment

# Over the C hot loops and their Python forms (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("accel_backend")


def _attach(ring_name: str, **kw: Any) -> Hook:
    hook = engine_hook.attach(
        strict=True,
        env={},
        instance_id="inst",
        ring_name=ring_name,
        ring_capacity_slots=kw.pop("capacity", 1024),
        **kw,
    )
    assert isinstance(hook, Hook)
    return hook


def _read_all(reader: RingReader) -> list[tuple[int, int, int]]:
    res = reader.read()
    return [
        (
            int(np.int64(np.uint64(k)).item()) if k < 1 << 63 else k - (1 << 64),
            m & 0xFF,
            (m >> 8) & 0xFF,
        )
        for _s, k, m, _p in res.records.tolist()
    ]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"publisher_type": "none"}, "publisher_type is none"),
        ({"publisher_type": "NONE"}, "publisher_type is none"),
        ({"tp_rank": 1}, "tp_rank=1"),
        ({"pp_size": 2}, "pp_size=2"),
        ({"cp_sharded_kv": True}, "context-parallel"),
        ({"prefix_reuse": False}, "prefix reuse is disabled"),
    ],
)
def test_attach_gated_rank_gets_null_hook_with_reason(
    fields: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    hook = engine_hook.attach(env={}, instance_id="i", **fields)
    assert isinstance(hook, NullHook)
    assert reason in hook.reason
    assert reason in caplog.text
    hook.stored(1)
    hook.removed([1, 2])
    hook.cleared()
    assert hook.flush() == 0
    assert hook.stats()["enabled"] is False


def test_attach_tp0_pp1_publishes(ring_name: str) -> None:
    hook = _attach(ring_name, tp_rank=0, pp_size=1, tp_size=4)
    assert hook.enabled
    hook.close()


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"KV_CACHE_EVENT_PUBLISHER_TYPE": "zmq"}, "publisher_type"),
        ({"KV_CACHE_EVENT_DP_RANK": "one"}, "KV_CACHE_EVENT_DP_RANK"),
        ({"KV_CACHE_EVENT_USE_MLA": "maybe"}, "KV_CACHE_EVENT_USE_MLA"),
        ({"KV_CACHE_EVENT_BLOCK_SIZE_TOKENS": "0"}, "block_size_tokens"),
        ({"KV_CACHE_EVENT_REQUIRED_GROUPS": "3"}, "required_groups"),
        ({"KV_CACHE_EVENT_MEDIUM": "h#m"}, "medium"),
        ({"KV_CACHE_EVENT_MEDIUMS": "hbm,d#sk"}, "medium"),
        ({"KV_CACHE_EVENT_MAX_STAGE_DELAY_MS": "nan"}, "max_stage_delay_ms"),
        ({"KV_CACHE_EVENT_MAX_STAGE_DELAY_MS": "inf"}, "max_stage_delay_ms"),
    ],
)
def test_attach_bad_config_names_field(env: dict[str, str], field: str) -> None:
    env = {"KV_CACHE_EVENT_INSTANCE_ID": "i", **env}
    with pytest.raises(DescriptorError, match=field):
        engine_hook.attach(env=env, strict=True)
    hook = engine_hook.attach(env=env)  # non-strict: the engine keeps running, unpublished
    assert isinstance(hook, NullHook) and field in hook.reason


def test_attach_kvcm_without_instance_id_is_config_error() -> None:
    with pytest.raises(DescriptorError, match="instance_id"):
        engine_hook.attach(env={}, strict=True)


def test_attach_reads_descriptor_from_env(ring_name: str) -> None:
    env = {
        "KV_CACHE_EVENT_INSTANCE_ID": "from-env",
        "KV_CACHE_EVENT_DP_RANK": "3",
        "KV_CACHE_EVENT_GROUP_BLOCK_BYTES": "100,200",
        "KV_CACHE_EVENT_REQUIRED_GROUPS": "0,1",
        "KV_CACHE_EVENT_RING_NAME": ring_name,
        "KV_CACHE_EVENT_USE_MLA": "true",
    }
    hook = engine_hook.attach(env=env, strict=True, model_name="arg-wins")
    assert isinstance(hook, Hook)
    seg = Segment(ring_name)
    d = Descriptor.from_json(seg.read_descriptor())
    assert (d.instance_id, d.dp_rank, d.model_name, d.use_mla) == ("from-env", 3, "arg-wins", True)
    assert d.group_block_bytes == (100, 200) and d.required_groups == (0, 1)
    assert d.block_bytes() == 300
    hook.close()
    seg.close()


def test_attach_never_raises_on_incompatible_ring(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    seg.hdr[L.W_VERSION_SLOT] = 99 | (32 << 32)
    hook = engine_hook.attach(env={}, instance_id="i", ring_name=ring_name)
    assert isinstance(hook, NullHook) and "upgrade the sidecar" in hook.reason
    seg.close()


def test_normalize_keys_to_int64_bit_pattern() -> None:
    assert normalize_keys(2**64 - 1).tolist() == [-1]
    assert normalize_keys([2**63, -5]).tolist() == [-(2**63), -5]
    assert normalize_keys(np.array([2**64 - 2], np.uint64)).tolist() == [-2]
    assert normalize_keys(np.array([7], np.int32)).tolist() == [7]
    with pytest.raises(OverflowError):
        normalize_keys([2**64])
    with pytest.raises(TypeError):
        normalize_keys(np.array([1.5]))


def test_hook_records_kind_group_and_key_in_order(ring_name: str) -> None:
    hook = _attach(ring_name, group_block_bytes=(10, 10), start_flusher=False)
    reader = RingReader(Segment(ring_name))
    hook.stored(5)
    hook.stored([2**64 - 1, 6], group=1)
    hook.removed(np.array([5], np.uint64))
    hook.cleared()
    assert hook.flush() == 5
    assert _read_all(reader) == [
        (5, L.KIND_STORED, 0),
        (-1, L.KIND_STORED, 1),
        (6, L.KIND_STORED, 1),
        (5, L.KIND_REMOVED, 0),
        (0, L.KIND_CLEARED, 0),
    ]
    hook.close()
    reader.close()


def test_hook_single_keys_grow_one_run_in_call_order(ring_name: str) -> None:
    """Block-by-block stored(k) calls with one meta share one staged word array (one run for
    the flush); another meta, a negative or oversize key, or a flush in between starts anew."""
    hook = _attach(ring_name, group_block_bytes=(10, 10), start_flusher=False)
    reader = RingReader(Segment(ring_name))
    for k in (1, 2, 3):
        hook.stored(k)
    assert len(hook._staged) == 1
    hook.stored(-4)  # KVCM's signed spelling: staged alone, wraps at the flush
    hook.stored(5)
    hook.stored(2**64 + 1)  # refused, counted: the others keep their order
    hook.stored(6, group=1)
    hook.removed(7)
    hook.stored(8)
    assert hook.flush() == 8
    hook.stored(9)
    assert hook.flush() == 1
    assert _read_all(reader) == [
        (1, L.KIND_STORED, 0),
        (2, L.KIND_STORED, 0),
        (3, L.KIND_STORED, 0),
        (-4, L.KIND_STORED, 0),
        (5, L.KIND_STORED, 0),
        (6, L.KIND_STORED, 1),
        (7, L.KIND_REMOVED, 0),
        (8, L.KIND_STORED, 0),
        (9, L.KIND_STORED, 0),
    ]
    assert hook.stats()["problems"]["bad_key"] == 1
    hook.close()
    reader.close()


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        (lambda h: h.stored("abc"), "bad_key"),
        (lambda h: h.stored(1.5), "bad_key"),
        (lambda h: h.stored(True), "bad_key"),
        (lambda h: h.stored([1, None]), "bad_key"),
        (lambda h: h.removed(np.array([0.5])), "bad_key"),
        (lambda h: h.stored(2**64 + 1), "bad_key"),
        (lambda h: h.stored(1, group=7), "bad_group"),
        (lambda h: h.stored(1, group=-1), "bad_group"),
        (lambda h: h.removed(1, group="x"), "bad_group"),
    ],
)
def test_hook_bad_argument_counted_never_raised(ring_name: str, call: Any, reason: str) -> None:
    hook = _attach(ring_name, start_flusher=False)
    call(hook)
    hook.flush()
    assert hook.stats()["problems"].get(reason) == 1
    hook.close()


def test_hook_full_ring_drops_counted_never_raised(ring_name: str) -> None:
    hook = _attach(ring_name, capacity=16, start_flusher=False)
    hook.stored(np.arange(40))
    assert hook.flush() == 16
    assert hook.stats()["dropped"] == 24


def test_hook_after_close_counts_and_does_not_raise(ring_name: str) -> None:
    hook = _attach(ring_name, start_flusher=False)
    hook.close()
    hook.close()
    hook.stored(1)
    hook.removed(1)
    assert hook.flush() == 0
    assert hook.stats()["problems"]["closed"] == 2


def test_hook_corrupt_ring_flush_counted(ring_name: str) -> None:
    hook = _attach(ring_name, start_flusher=False)
    hook._writer._slots = None  # type: ignore[assignment]  # simulate a broken mapping
    hook._writer._words = None  # type: ignore[assignment]
    hook.stored([1, 2])
    assert hook.flush() == 0
    assert hook.stats()["problems"]["flush_failed"] == 1
    hook.close()


def test_hook_missing_snapshot_source_fails_request_not_engine(ring_name: str) -> None:
    hook = _attach(ring_name, start_flusher=False)

    def broken() -> tuple[np.ndarray, np.ndarray]:
        raise RuntimeError("engine cannot enumerate right now")

    hook.set_snapshot_provider(broken)
    seg = Segment(ring_name)
    from sidecar.shm_ring import snapshot

    req = snapshot.request(seg)
    hook.flush()
    with pytest.raises(snapshot.SnapshotFailed):
        snapshot.poll(seg, req)
    assert hook.stats()["problems"]["snapshot_failed"] == 1
    hook.close()
    seg.close()


def test_hook_idle_engine_records_visible_within_stage_delay(ring_name: str) -> None:
    hook = _attach(ring_name, max_stage_delay_ms=2.0)
    reader = RingReader(Segment(ring_name))
    t0 = time.monotonic()
    hook.stored(42)  # and the engine never calls flush()
    got: list[int] = []
    while not got and time.monotonic() - t0 < 10:
        got = [int(k) for k in reader.read().records[:, L.C_KEY]]
    assert got == [42]
    hook.close()
    reader.close()


def test_hook_threads_stage_concurrently_without_loss(ring_name: str) -> None:
    import threading

    hook = _attach(ring_name, capacity=1 << 16, max_stage_delay_ms=1.0)
    reader = RingReader(Segment(ring_name))

    def work(base: int) -> None:
        for i in range(5000):
            hook.stored(base + i)

    threads = [threading.Thread(target=work, args=(b * 100000,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = sorted(b * 100000 + i for b in range(4) for i in range(5000))
    got: list[int] = []
    deadline = time.monotonic() + 10
    # flush() never waits for a concurrent flusher, so wait on the ring itself, bounded.
    while len(got) < len(want) and time.monotonic() < deadline:
        hook.flush()
        got += reader.read().records[:, L.C_KEY].astype(np.int64).tolist()
    assert sorted(got) == want
    hook.close()
    reader.close()


def test_import_engine_hook_loads_nothing_heavy() -> None:
    code = (
        "import sys, engine_hook, engine_hook.block_cache, engine_hook.rolling_hash\n"
        "bad = [m for m in ('aiohttp', 'uvloop', 'prometheus_client', 'msgspec') "
        "if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_resident_fold_imports_nothing_at_run_time() -> None:
    # np.unique's first call imports numpy.ma: 10-30 ms holding the GIL, in the engine's flush
    # (it showed as 200+ ns per event at 80 k events/s in bench.hotpath). The fold, a crowded
    # index, re-indexes, several mediums and the snapshot export must not import anything.
    code = (
        "import sys, numpy as np\n"
        "from engine_hook.resident import ResidentSet\n"
        "from sidecar.shm_ring import layout as L\n"
        "rs = ResidentSet(capacity=1 << 10)\n"
        "rng = np.random.default_rng(1)\n"
        "before = set(sys.modules)\n"
        "for i in range(40):\n"
        "    keys = rng.integers(-(2**63), 2**63 - 1, 600, dtype=np.int64)\n"
        "    metas = np.array([L.pack_meta(L.KIND_STORED, 0, i % 3)] * 600, np.uint64)\n"
        "    rs.apply(np.concatenate([keys, keys]), np.concatenate([metas, metas]))\n"
        "    rs.fold()\n"
        "rs.export()\n"
        "print(','.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_hook_medium_names_map_to_the_record_medium_index(ring_name: str) -> None:
    hook = _attach(ring_name, medium="hbm", mediums=("mem", "hbm", "disk"), start_flusher=False)
    assert hook.descriptor.medium_table() == ("hbm", "mem", "disk")  # the default is index 0
    reader = RingReader(Segment(ring_name))
    hook.stored(1)
    hook.stored([2, 3], medium="mem")
    hook.removed(np.array([4], np.int64), medium="disk")
    hook.stored(5, medium="hbm")
    hook.flush()
    res = reader.read()
    got = [(int(k), L.meta_kind(int(m)), L.meta_medium(int(m))) for _s, k, m, _p in res.records]
    assert got == [
        (1, L.KIND_STORED, 0),
        (2, L.KIND_STORED, 1),
        (3, L.KIND_STORED, 1),
        (4, L.KIND_REMOVED, 2),
        (5, L.KIND_STORED, 0),
    ]
    reader.close()
    hook.close()


def test_hook_unknown_medium_is_counted_never_raised(ring_name: str) -> None:
    hook = _attach(ring_name, mediums=("hbm", "mem"), start_flusher=False)
    hook.stored(1, medium="ssd")
    hook.removed([1, 2], group=0, medium="ssd")
    hook.stored(1, group=7)
    hook.flush()
    st = hook.stats()
    assert st["problems"] == {"bad_medium": 2, "bad_group": 1}
    assert st["last_seq"] == 0  # nothing of the refused calls reached the ring
    hook.close()


def test_hook_bad_key_inside_a_list_costs_only_itself(ring_name: str) -> None:
    hook = _attach(ring_name, start_flusher=False)
    reader = RingReader(Segment(ring_name))
    hook.stored([1, "x", 2, 2**64, 3])
    hook.flush()
    assert [int(k) for k in reader.read().records[:, L.C_KEY]] == [1, 2, 3]
    assert hook.stats()["problems"] == {"bad_key": 1}
    reader.close()
    hook.close()


def test_hook_a_key_whose_repr_fails_costs_only_itself(ring_name: str) -> None:
    # Review: the messages repr'd the bad key; an int over 4 300 digits cannot be repr'd
    # (ValueError), so a list lost its good keys, and a tuple (checked at the flush) made
    # every flush fail and put its chunk back: nothing was published again.
    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    class Index:
        def __index__(self) -> int:
            return 9

    hook = _attach(ring_name, start_flusher=False)
    reader = RingReader(Segment(ring_name))
    hook.stored([1, 2, 10**5000])
    hook.stored((3, 10**5000))
    hook.stored([4, BadRepr()])
    hook.stored([5, Index()])  # int-like: a key, as array('Q') takes it
    hook.stored(6, group=BadRepr())  # type: ignore[arg-type]
    hook.flush()
    hook.stored([7])
    hook.flush()
    assert [int(k) for k in reader.read().records[:, L.C_KEY]] == [1, 2, 3, 4, 5, 9, 7]
    problems = hook.stats()["problems"]
    assert problems.get("bad_key") == 3 and "flush_failed" not in problems
    assert hook.stats()["staged"] == 0
    reader.close()
    hook.close()


def test_hook_a_bool_is_never_a_key_alone_or_in_a_list(ring_name: str) -> None:
    # One rule (it used to pass as 0/1 inside a list of good keys, and be refused alone or
    # beside a bad key): refused, counted, costing only itself; np.int64 items are keys.
    hook = _attach(ring_name, start_flusher=False)
    reader = RingReader(Segment(ring_name))
    hook.stored([5, True, 6])
    hook.stored(True)
    hook.removed([False])
    hook.stored([7, np.int64(8), -1])
    hook.flush()
    keys = [int(k) for k in reader.read().records[:, L.C_KEY].view(np.int64)]
    assert keys == [5, 6, 7, 8, -1]
    assert hook.stats()["problems"] == {"bad_key": 3}
    reader.close()
    hook.close()


def test_snapshot_from_a_producer_without_mediums_reads_as_medium_0(ring_name: str) -> None:
    from sidecar.shm_ring import snapshot

    seg = Segment(ring_name, 64)
    w = snapshot.SnapshotWriter(seg)
    req = snapshot.request(seg)
    w.publish(
        req,
        0,
        1,
        0,
        np.array([7, 8], np.int64),
        np.array([1, 1], np.uint32),
        np.array([2, 1], np.uint8),
    )
    assert snapshot.poll(seg, req).mediums.tolist() == [2, 1]  # type: ignore[union-attr]
    assert w._mm is not None
    hv = np.ndarray((8,), np.uint64, buffer=w._mm)
    hv[L.SW_FLAGS] = 0  # as a producer from before mediums leaves a fresh segment
    seg.hdr[L.W_SNAP_BYTES] = L.snapshot_bytes(int(hv[L.SW_CAPACITY]), 0)
    snap = snapshot.poll(seg, req)
    assert snap is not None and snap.keys.tolist() == [7, 8] and snap.mediums.tolist() == [0, 0]
    # An engine rolled back to such a producer after a newer one wrote the segment: the flags
    # word is stale, but the answer's size (12-byte entries, its own capacity) tells.
    hv[L.SW_FLAGS] = L.SNAP_FLAG_MEDIUMS
    old_cap = (int(seg.hdr[L.W_SNAP_BYTES]) - L.SNAP_HEADER_SIZE) // 12
    hv[L.SW_CAPACITY] = old_cap
    seg.hdr[L.W_SNAP_BYTES] = L.snapshot_bytes(old_cap, 0)
    np.ndarray((2,), np.uint32, buffer=w._mm, offset=L.SNAP_HEADER_SIZE + 8 * old_cap)[:] = 1
    snap = snapshot.poll(seg, req)
    assert snap is not None and snap.keys.tolist() == [7, 8] and snap.mediums.tolist() == [0, 0]
    assert snap.masks.tolist() == [1, 1]
    del hv
    w.close()
    seg.close()


def test_writer_ignores_a_garbage_reader_cursor_at_attach(ring_name: str) -> None:
    from sidecar.shm_ring.writer import RingWriter

    seg = Segment(ring_name, 16)
    seg.hdr[L.W_HEAD] = 1 << 40  # far beyond the tail: not a cursor a reader could have left
    w = RingWriter(seg)
    assert w.free_slots() <= 16  # never more room than the ring has
    assert w.write(np.arange(20, dtype=np.int64), L.pack_meta(L.KIND_STORED)) == 16
    assert w.dropped == 4
    w.close()
    seg.close()


def test_hook_flush_that_raises_loses_nothing(ring_name: str) -> None:
    """A ring write that raises (MemoryError, say) after the staged list was cut: the chunk goes
    back first in line and the next flush publishes it, in order, to ring and resident set."""
    hook = _attach(ring_name, start_flusher=False)
    reader = RingReader(Segment(ring_name))
    w = hook._writer
    names = ("write", "write_pairs", "write_words", "write_step", "write_runs")
    real = {name: getattr(w, name) for name in names}

    def broken(*args: Any) -> int:
        raise MemoryError("injected")

    for name in names:
        setattr(w, name, broken)
    hook.stored([1, 2])
    hook.removed(1)
    assert hook.flush() == 0
    assert hook.stats()["problems"] == {"flush_failed": 1}
    hook.stored(3)  # staged behind the chunk that failed
    for name in names:
        setattr(w, name, real[name])
    hook.flush()
    got = [(int(k), L.meta_kind(int(m))) for _s, k, m, _p in reader.read().records]
    assert got == [(1, L.KIND_STORED), (2, L.KIND_STORED), (1, L.KIND_REMOVED), (3, L.KIND_STORED)]
    assert hook._resident is not None and hook._resident.as_dict() == {(2, 0): 1, (3, 0): 1}
    reader.close()
    hook.close()


def test_resident_fold_that_raises_keeps_its_queue() -> None:
    from engine_hook import resident

    rs = resident.ResidentSet()
    rs.apply(np.array([5, 6], np.int64), np.full(2, L.pack_meta(L.KIND_STORED), np.uint64))
    real = rs._fold_segment

    def broken(*args: Any) -> None:
        raise MemoryError("injected")

    rs._fold_segment = broken  # type: ignore[method-assign, assignment]
    with pytest.raises(MemoryError):
        rs.export()
    rs._fold_segment = real  # type: ignore[method-assign]
    assert rs.as_dict() == {(5, 0): 1, (6, 0): 1}


def test_hook_unsetting_no_provider_keeps_the_resident_set(ring_name: str) -> None:
    hook = _attach(ring_name, start_flusher=False)
    hook.stored([1, 2, 3])
    hook.flush()
    hook.set_snapshot_provider(None)  # there was none: the hook's record must survive
    assert hook._resident is not None and len(hook._resident.as_dict()) == 3
    hook.set_snapshot_provider(lambda: (np.empty(0, np.int64), np.empty(0, np.uint32)))
    hook.set_snapshot_provider(None)  # a provider removed: counted, the record starts empty
    assert hook.stats()["problems"].get("provider_removed") == 1
    hook.close()


@pytest.mark.parametrize("head_at", [0, 5, 12])
def test_writer_write_runs_matches_write_across_the_wrap_and_when_full(
    ring_name: str, head_at: int
) -> None:
    """write_runs (a step's lists as 'Q' runs, one meta each) stores exactly what write() would:
    in one piece, across the ring's end, and dropping the newest beyond the free slots."""
    from array import array

    from sidecar.shm_ring.writer import RingWriter

    stored, removed = L.pack_meta(L.KIND_STORED, 1), L.pack_meta(L.KIND_REMOVED, 0, 2)
    seg = Segment(ring_name, 16)
    w = RingWriter(seg)
    reader = RingReader(Segment(ring_name))
    w.write(np.arange(100, 100 + head_at, dtype=np.int64), stored)
    reader.read()  # the head follows: the next write starts at slot head_at
    runs = [(array("Q", [1, 2**64 - 1, 3]), stored), (array("Q", range(10, 25)), removed)]
    assert w.write_runs(runs, 18) == 16  # 16 free slots: the last two records are dropped
    assert w.dropped == 2 and w.last_seq == head_at + 16
    recs = reader.read().records
    want_keys = [1, -1, 3, *range(10, 23)]
    assert [int(k) for k in recs[:, L.C_KEY].view(np.int64)] == want_keys
    assert [int(m) for m in recs[:, L.C_META]] == [stored] * 3 + [removed] * 13
    assert [int(s) for s in recs[:, L.C_SEQ]] == list(range(head_at + 1, head_at + 17))
    assert not recs[:, L.C_PARENT].any()
    assert w.write_runs([(array("Q", [7, 8]), stored)], 2) == 2  # room again, wrapped or not
    assert [int(k) for k in reader.read().records[:, L.C_KEY]] == [7, 8]
    reader.close()
    w.close()
    seg.close()


@pytest.mark.parametrize("head_at", [0, 5, 12])
def test_writer_write_step_stores_what_write_runs_does_or_nothing(
    ring_name: str, head_at: int, accel_backend: str
) -> None:
    """write_step (C put_runs, or its Python form) = write_runs for a step of 'Q' runs, in one
    piece, across the ring's end and when full; C also takes a single int key; anything else
    staged writes nothing (None: the caller's general path)."""
    from array import array

    from sidecar.shm_ring.writer import RingWriter

    stored, removed = L.pack_meta(L.KIND_STORED, 1), L.pack_meta(L.KIND_REMOVED, 0, 2)
    seg = Segment(ring_name, 16)
    w = RingWriter(seg)
    reader = RingReader(Segment(ring_name))
    w.write(np.arange(100, 100 + head_at, dtype=np.int64), stored)
    reader.read()
    odd_items = (
        [(True, stored)],  # a bool is no key (an int key alone is taken in C, below)
        [(2**64, stored)],
        [(-(2**63) - 1, stored)],
        [([1, 2], stored)],
        [(np.arange(2), stored)],
        [(b"x" * 8, 1)],
        [(array("q", [1]), stored)],
        [(memoryview(array("Q", [1])), stored)],  # format 'Q', but not the hook's word array
        [(np.array([1], np.ulonglong), stored)],
        [(array("Q", [1]), True)],
        [(array("Q", [1]), -1)],
    )
    for odd in odd_items:
        assert w.write_step([(array("Q", [1]), stored), *odd]) is None
        assert w.last_seq == head_at and not len(reader.read().records)
    singles: list[Any] = [(array("Q", [4]), stored), (5, stored), (-1, removed)]
    if accel_backend == "c":
        assert w.write_step(singles) == (3, 3)
        got = reader.read().records
        assert [int(k) for k in got[:, L.C_KEY]] == [4, 5, 2**64 - 1]
        assert [int(m) for m in got[:, L.C_META]] == [stored, stored, removed]
        head_at += 3
    else:
        assert w.write_step(singles) is None
    runs = [(array("Q", [1, 2**64 - 1]), stored), (array("Q", range(10, 13)), removed)]
    assert w.write_step(runs) == (5, 5)
    recs = reader.read().records
    assert [int(k) for k in recs[:, L.C_KEY].view(np.int64)] == [1, -1, 10, 11, 12]
    assert [int(m) for m in recs[:, L.C_META]] == [stored] * 2 + [removed] * 3
    assert [int(s) for s in recs[:, L.C_SEQ]] == list(range(head_at + 1, head_at + 6))
    assert not recs[:, L.C_PARENT].any()
    assert int(seg.hdr[L.W_TAIL]) == head_at + 5 and int(seg.hdr[L.W_LAST_SEQ]) == head_at + 5
    big = [(array("Q", range(20, 40)), stored)]  # 20 records, 16 free: the newest 4 dropped
    assert w.write_step(big) == (16, 20)
    assert w.dropped == 4
    assert [int(k) for k in reader.read().records[:, L.C_KEY]] == list(range(20, 36))
    assert w.write_step([]) == (0, 0)
    reader.close()
    w.close()
    seg.close()


def test_writer_write_step_single_keys_across_the_wrap_and_when_full(
    ring_name: str, accel_backend: str
) -> None:
    """Single int keys in a step that wraps past the ring's end, or overflows it, go the slow
    way (write_runs' piece by piece copy) like word arrays do."""
    from array import array

    from sidecar.shm_ring.writer import RingWriter

    meta = L.pack_meta(L.KIND_STORED)
    seg = Segment(ring_name, 16)
    w = RingWriter(seg)
    reader = RingReader(Segment(ring_name))
    w.write(np.arange(14, dtype=np.int64), meta)
    reader.read()
    step: list[Any] = [(1, meta), (array("Q", [2, 3]), meta), (-4, meta)]
    if accel_backend != "c":
        assert w.write_step(step) is None  # the caller's general path
        return
    assert w.write_step(step) == (4, 4)  # slots 14, 15, 0, 1
    assert [int(k) for k in reader.read().records[:, L.C_KEY].view(np.int64)] == [1, 2, 3, -4]
    assert w.write_step([(k, meta) for k in range(20)]) == (16, 20)
    assert w.dropped == 4
    assert [int(k) for k in reader.read().records[:, L.C_KEY]] == list(range(16))
    reader.close()
    w.close()
    seg.close()


def test_writer_seq_words_stay_dense_across_blocks_and_paths(
    ring_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seq words made ahead (SEQ_BLOCK at a time) follow every path that advances the
    sequence: runs, word arrays, numpy arrays and scalar pairs, across block boundaries."""
    from array import array

    from sidecar.shm_ring import writer as writer_mod

    monkeypatch.setattr(writer_mod, "SEQ_BLOCK", 8)
    meta = L.pack_meta(L.KIND_STORED)
    seg = Segment(ring_name, 64)
    w = writer_mod.RingWriter(seg)
    reader = RingReader(Segment(ring_name))
    seqs: list[int] = []
    for i in range(12):
        w.write_runs([(array("Q", range(i, i + 5 + i % 7)), meta)], 5 + i % 7)
        if i % 3 == 0:
            w.write_pairs([(7, meta)])
        if i % 4 == 0:
            w.write_words(array("Q", [1, 2, 3]), array("Q", [meta] * 3))
        if i % 5 == 0:
            w.write(np.arange(4, dtype=np.int64), meta)
        seqs += [int(s) for s in reader.read().records[:, L.C_SEQ]]
    assert seqs == list(range(1, len(seqs) + 1)) and w.dropped == 0
    reader.close()
    w.close()
    seg.close()
