"""The key table and re-keying in C (sidecar/shm_ring/_rekey.c) against the Python reference
(sidecar/source/rekey.py): the same random event streams (every rule's events: chains, unknown
parents, LoRA, extra keys, other kinds, tokenless, malformed, duplicates, removals, forgets,
clears, checkpoints crossing forms) into both, at tiny capacities so that eviction runs; the
outputs, the counts and the tables must be equal after every batch."""

from __future__ import annotations

import hashlib
import itertools
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.shm_ring import compiled
from sidecar.source.rekey import Rekey, load_table, save_table
from sidecar.source.zmq_events import EventDecoder, to_blocks

pytestmark = pytest.mark.skipif(
    compiled.accel is None or not hasattr(compiled.accel, "KeyTable"),
    reason="the C loops were not built (no compiler at install)",
)

_ENC = msgspec.msgpack.Encoder()


def h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def make(e: int, k: int, capacity: int, both: bool, sglang: bool, c: bool, lora: str = "") -> Rekey:
    built = compiled.accel
    compiled.accel = built if c else None
    try:
        return Rekey(e, k, both=both, capacity=capacity, sglang=sglang, lora_adapter=lora)
    finally:
        compiled.accel = built


def table_of(r: Rekey) -> tuple[dict[tuple[int, int], tuple[int, int, tuple[int, ...]]], int]:
    g, k, s, m, x, epoch = r.table.export()
    gs = np.frombuffer(g, "u1").tolist()
    ks = np.frombuffer(k, "<i8").tolist()
    ss = np.frombuffer(s, "<u8").tolist()
    ms = np.frombuffer(m, "<u8").tolist()
    xs = np.frombuffer(x, "<i8").tolist()
    d = r.table.down - 1
    out = {(gs[i], ks[i]): (ss[i], ms[i], tuple(xs[i * d : (i + 1) * d])) for i in range(len(gs))}
    assert len(out) == len(gs) == r.table.n
    return out, epoch


def same(a: Rekey, b: Rekey) -> None:
    assert a.counts.tolist() == b.counts.tolist()
    assert (a.table.n, a.table.evictions) == (b.table.n, b.table.evictions)
    assert table_of(a) == table_of(b)


class Stream:
    """Builds vLLM-format batches of the events the ops ask for."""

    def __init__(self, e: int, docs: list[list[int]], positional: bool) -> None:
        self.e, self.docs, self.positional = e, docs, positional
        self.dec = EventDecoder({"GPU": 0, "CPU": 1}, e, 0, full=True)

    def bid(self, doc: int, i: int, ns: str) -> int:
        return h(ns, tuple(self.docs[doc][: (i + 1) * self.e]))

    def stored(self, hashes: list[int], tokens: Any, parent: Any, **kw: Any) -> Any:
        f = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.e,
            "lora_id": kw.get("lora_id"),
            "medium": kw.get("medium"),
            "lora_name": kw.get("lora_name"),
            "extra_keys": kw.get("extra_keys"),
            "group_idx": kw.get("group_idx"),
            "kv_cache_spec_kind": kw.get("kind"),
        }
        if self.positional:
            return ["BlockStored", *f.values()]
        return {"type": "BlockStored", **f}

    def removed(self, hashes: list[int], medium: Any = None, group: Any = None) -> Any:
        if self.positional:
            return ["BlockRemoved", hashes, medium, group]
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": medium,
            "group_idx": group,
        }

    def batch(self, events: list[Any]) -> tuple[Any, list[Any]]:
        d = self.dec.decode(_ENC.encode([1.0, events, 0]))
        assert d.ok
        segs = [p for p in d.parts if not isinstance(p, str)]
        return to_blocks(segs), [x for p in segs for x in p.events]


FLAGS = [None] * 8 + [
    "lora_id",
    "lora_name",
    "salt",
    "extra",
    "extra_empty",
    "sliding",
    "full_kind",
    "mla_kind",
    "tokenless",
    "short",
    "strings",
    "bytes_parent",
    "orphan",
    "group1",
    "cpu",
]
STORE = st.tuples(
    st.integers(0, 2),  # document
    st.integers(0, 5),  # first block
    st.integers(1, 4),  # blocks
    st.integers(1, 3),  # events it is split into
    st.sampled_from(FLAGS),
)
OP = st.one_of(
    st.tuples(st.just("store"), STORE),
    st.tuples(st.just("store"), STORE),
    st.tuples(st.just("store"), STORE),
    st.tuples(st.just("dup"), STORE),
    st.tuples(
        st.just("remove"),
        st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.booleans()), max_size=4),
    ),
    st.tuples(st.just("forget"), st.none()),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("checkpoint"), st.none()),
    st.tuples(st.just("capacity"), st.integers(1, 12)),
)


def events_of(s: Stream, arg: Any) -> list[Any]:
    doc, first, n, splits, flag = arg
    e = s.e
    last = min(first + n, 6)
    ns = "lora" if flag in ("lora_id", "lora_name") else ""
    blocks = list(range(first, last))
    parent: Any = s.bid(doc, first - 1, ns) if first else None
    if flag == "orphan":
        parent = h("never", doc, first)
    bounds = sorted({0, len(blocks), *[(len(blocks) * j) // splits for j in range(splits)]})
    out = []
    for lo, hi in itertools.pairwise(bounds):
        part = blocks[lo:hi]
        toks: Any = s.docs[doc][(first + lo) * e : (first + hi) * e]
        kw: dict[str, Any] = {}
        if flag == "lora_id":
            kw["lora_id"] = 7
        elif flag == "lora_name":
            kw["lora_name"] = "adapter"
        elif flag == "salt" and first + lo == 0:
            kw["extra_keys"] = [["salt"]] + [None] * (len(part) - 1)
        elif flag == "extra":
            kw["extra_keys"] = [None] * (len(part) - 1) + [[["mm", 1]]]
        elif flag == "extra_empty":
            kw["extra_keys"] = [None, []] * len(part)
        elif flag == "sliding":
            kw["kind"] = "sliding_window"
        elif flag == "full_kind":
            kw["kind"] = "FullAttentionSpec"
        elif flag == "mla_kind":
            kw["kind"] = "MLAAttentionSpec"
        elif flag == "tokenless":
            toks = []
        elif flag == "short":
            toks = toks[:-1]
        elif flag == "strings":
            toks = [str(t) for t in toks]
        elif flag == "group1":
            kw["group_idx"] = 1
        elif flag == "cpu":
            kw["medium"] = "CPU"
        p = parent
        if flag == "bytes_parent" and p is not None:
            p = bytes(24) + p.to_bytes(8, "big")
        out.append(s.stored([s.bid(doc, i, ns) for i in part], toks, p, **kw))
        parent = s.bid(doc, part[-1], ns)
    return out


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    ratio=st.sampled_from([(4, 4), (1, 4), (4, 1), (2, 8), (8, 2), (1, 1)]),
    ops=st.lists(OP, min_size=4, max_size=30),
    capacity=st.sampled_from([1, 2, 3, 5, 8, 1000]),
    both=st.booleans(),
    sglang=st.booleans(),
    positional=st.booleans(),
    per_batch=st.integers(1, 4),
    lora=st.sampled_from(["", "", "", "adapter", "7"]),  # a LoRA adapter's own instance
)
def test_rekey_c_matches_the_python_reference(
    data: st.DataObject,
    ratio: tuple[int, int],
    ops: list[Any],
    capacity: int,
    both: bool,
    sglang: bool,
    positional: bool,
    per_batch: int,
    lora: str,
) -> None:
    e, k = ratio
    both = both and not lora  # the config allows an adapter only in rolling
    docs = [
        data.draw(st.lists(st.integers(1, 2), min_size=6 * e, max_size=6 * e)) for _ in range(3)
    ]
    s = Stream(e, docs, positional)
    c = make(e, k, capacity, both, sglang, True, lora)
    py = make(e, k, capacity, both, sglang, False, lora)
    assert hasattr(c.table, "rekey") and not hasattr(py.table, "rekey")
    pending: list[Any] = []

    def flush() -> None:
        if not pending:
            return
        f, evs = s.batch(pending)
        pending.clear()
        n = len(f.codes)
        cut = data.draw(st.integers(0, n))  # a fold of two ranges, as the Stream's repair does
        for lo, hi in ((0, cut), (cut, n)):
            a = c.apply(f, lo, hi, evs)
            b = py.apply(f, lo, hi, evs)
            for col in ("keys", "mediums", "groups", "signs"):
                assert getattr(a, col).tolist() == getattr(b, col).tolist(), col
            same(c, py)

    for op, arg in ops:
        if op in ("store", "dup"):
            evs = events_of(s, arg)
            pending += evs + (evs if op == "dup" else [])
        elif op == "remove":
            pending += [s.removed([s.bid(doc, i, "lora" if lora else "")]) for doc, i, lora in arg]
        if len(pending) >= per_batch or op not in ("store", "dup", "remove"):
            flush()
        if op == "forget":
            c.forget()
            py.forget()
        elif op == "clear":
            c.clear()
            py.clear()
        elif op == "capacity":
            c.table.capacity = py.table.capacity = arg
        elif op == "checkpoint":  # each form loads the other's file
            with tempfile.TemporaryDirectory() as d:
                pc, pp = str(Path(d) / "c.keys"), str(Path(d) / "p.keys")
                save_table(pc, "fp", "", c)
                save_table(pp, "fp", "", py)
                c2 = make(e, k, c.table.capacity, both, sglang, True)
                p2 = make(e, k, c.table.capacity, both, sglang, False)
                assert load_table(pp, "fp", c2) == ""
                assert load_table(pc, "fp", p2) == ""
            c2.counts[:] = c.counts
            p2.counts[:] = py.counts
            assert table_of(c2) == table_of(p2)
            c, py = c2, p2
        same(c, py)
    flush()
    same(c, py)


def test_rekey_c_table_evicts_by_epochs_and_spares_held() -> None:
    c = make(1, 1, 16, False, False, True)
    t = c.table
    for key in range(40):
        t.put(0, key, 0 if key % 5 else 1 << 64)  # every 5th held
    t.evict()
    assert t.n <= 16 and t.evictions == 40 - t.n
    for key in range(0, 40, 5):
        assert t.get(0, key) is not None  # held: never evicted
    assert t.get(0, 39) is not None  # the newest epoch stays


def test_rekey_c_table_memory_is_24_bytes_a_slot_at_most_three_quarters_full() -> None:
    c = make(16, 16, 100_000, False, False, True)
    t = c.table
    for key in range(100_000):
        t.put(0, key, 1 << 64)
    assert t.n == 100_000
    slots = t.slots  # type: ignore[attr-defined]
    assert 100_000 * 4 / 3 <= slots <= 100_000 * 4 / 3 + 2  # sized to its capacity at the end
