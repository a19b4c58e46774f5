"""The hook's own record of resident (key, medium, group), for engines that cannot enumerate theirs.

Imports: numpy + sidecar.shm_ring.layout. Block metadata lives in arrays (DESIGN §5): per medium,
dense (key, mask) arrays indexed by an open-addressing hash table, updated in bulk. The hook
applies every transition it was handed, whether the ring accepted or dropped it: this is the truth
a resync rebuilds from. Records are queued and folded in when the queue is long (`fold_at`), when
the owner calls `fold()` (the hook's flusher, between engine steps) or when a snapshot is asked
for, so `export()` is exactly the fold of every record applied so far. Not thread-safe: the hook
calls apply/fold/export only under its flush token.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np

from sidecar.shm_ring import compiled
from sidecar.shm_ring.fold import fold_ops
from sidecar.shm_ring.key_table import KeyTable
from sidecar.shm_ring.layout import KIND_CLEARED, KIND_REMOVED, KIND_STORED

# Queued records before a fold: amortises numpy's fixed per-call cost, while keeping one fold
# (which runs in the engine's flush) to a few ms; 65 536 made a fold of new keys take 25-80 ms.
FOLD_AT = 1 << 13
_MIN_CAP = 1 << 16


def _word(key: int) -> bytes:
    """One key in [-2^63, 2^64) as the u64 word of KVCM's signed bit pattern."""
    return (key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, sys.byteorder)


def _bits(pos: np.ndarray, metas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pos, group bits set, group bits cleared) of records that are each their key's only op."""
    bits = np.left_shift(np.int64(1), ((metas >> np.uint64(8)) & np.uint64(0xFF)).astype(np.int64))
    kinds = metas & np.uint64(0xFF)
    return pos, np.where(kinds == KIND_STORED, bits, 0), np.where(kinds == KIND_REMOVED, bits, 0)


class RunQueue:
    """Runs applied but not yet folded: `items`, (keys, meta) in call order, holding `n`
    records. _accel.RunQueue is its twin in C, the one the hook's C flush (_accel.Publisher)
    appends an engine step's runs to without a Python call."""

    __slots__ = ("items", "n")

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any]] = []
        self.n = 0


def _run_queue() -> RunQueue:
    accel = compiled.accel
    q: RunQueue = accel.RunQueue() if accel is not None else RunQueue()
    return q


class ResidentSet:
    """(medium, key) -> group mask: per medium, dense (key, mask) columns behind a hash index.

    A removed key keeps its dense entry with mask 0 until the next re-index, so `export()` is
    slice copies (the snapshot format treats mask-0 entries as "not held"). The re-index is
    done a bounded piece per fold (sidecar/shm_ring/key_table.py), so no flush pays for all of it.
    """

    def __init__(self, capacity: int = _MIN_CAP) -> None:
        self._capacity = capacity
        self._tables: dict[int, KeyTable] = {0: self._table()}
        # In call order: (keys, metas) with keys a contiguous int64 ndarray or the hook's 'Q'
        # word array, metas one meta for the whole run (an engine step's list) or a buffer of
        # one per key. Joined and converted at the fold, off the engine's step: a numpy call per
        # flush costs far more than the conversion of a whole fold.
        self.queue = _run_queue()
        self.fold_at: int | None = None  # None: the module's FOLD_AT

    def _table(self) -> KeyTable:
        return KeyTable({"masks": np.uint32}, live=("masks",), min_capacity=self._capacity)

    @property
    def _t(self) -> KeyTable:
        """The default medium's table (most engines have no other)."""
        return self._tables[0]

    @property
    def _cap(self) -> int:
        return max(t.idx.cap for t in self._tables.values())

    # ---- recording ------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Records applied but not yet folded."""
        return self.queue.n

    def apply(self, keys: np.ndarray, metas: np.ndarray, *, copy: bool = True) -> None:
        """Queue records (in call order). `copy=False` when the caller hands over fresh arrays."""
        if not len(keys):
            return
        if copy:
            self._enqueue(np.array(keys, np.int64), np.array(metas, np.uint64), len(keys))
        else:
            k, m = np.ascontiguousarray(keys, np.int64), np.ascontiguousarray(metas, np.uint64)
            self._enqueue(k, m, len(keys))

    def apply_words(self, keys: array[int], metas: array[int]) -> None:
        """apply() for u64 word arrays (keys in KVCM's signed bit pattern); takes ownership."""
        if len(keys):
            self._enqueue(keys, metas, len(keys))

    def apply_runs(self, runs: list[tuple[array[int] | int, int]], n: int) -> None:
        """apply() for (u64 word array or one int key, one meta) runs holding n records;
        takes ownership."""
        q = self.queue
        q.items += runs
        q.n += n
        if q.n >= (self.fold_at or FOLD_AT):
            self._fold()

    def _enqueue(self, keys: Any, metas: Any, n: int) -> None:
        q = self.queue
        q.items.append((keys, metas))
        q.n += n
        if q.n >= (self.fold_at or FOLD_AT):
            self._fold()

    def fold(self) -> None:
        """Fold every queued record into the tables now."""
        self._fold()

    def apply_pairs(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if pairs:
            keys = [k - (1 << 64) if k >= 1 << 63 else k for k, _ in pairs]
            self.apply(np.array(keys, np.int64), np.array([m for _, m in pairs], np.uint64))

    def _fold(self) -> None:
        if not self.queue.n:
            return
        q = self.queue.items
        # A run's keys: an int64 ndarray, a 'Q' array, or one int key (a single-key call).
        keys = np.frombuffer(
            b"".join([k if type(k) is not int else _word(k) for k, _ in q]), np.int64
        )
        run_metas = [m for _, m in q]
        if all(type(m) is int for m in run_metas):
            # Runs (the hook's step lists): one meta each, so kinds and mediums are known
            # without a pass over the records.
            counts = [1 if type(k) is int else len(k) for k, _ in q]
            metas = np.repeat(np.array(run_metas, np.uint64), counts)
            distinct = set(run_metas)
            cleared = any(m & 0xFF == KIND_CLEARED for m in distinct)
            one_medium = all((m >> 16) & 0xFF == 0 for m in distinct)
        else:
            parts = [
                m if type(m) is not int else array("Q", [m]) * (1 if type(k) is int else len(k))
                for k, m in q
            ]
            metas = np.frombuffer(b"".join(parts), np.uint64)
            cleared, one_medium = True, False  # look at the records
        start = 0
        if cleared:
            kinds = metas & np.uint64(0xFF)
            for c in np.flatnonzero(kinds == KIND_CLEARED).tolist():
                self._fold_segment(keys[start:c], metas[start:c])
                self._tables = {0: self._table()}  # every medium and group gone
                start = c + 1
        self._fold_segment(keys[start:], metas[start:], one_medium)
        # Only now: a fold that raised (MemoryError while a table grows) keeps the queue, and
        # folding it again is harmless (the same ops in the same order end in the same state).
        self.queue.items, self.queue.n = [], 0

    def _fold_segment(self, keys: np.ndarray, metas: np.ndarray, one_medium: bool = False) -> None:
        if not len(keys):
            return
        if one_medium:
            self._fold_medium(0, keys, metas)
            return
        med = (metas >> np.uint64(16)) & np.uint64(0xFF)
        if not med.any():
            self._fold_medium(0, keys, metas)
            return
        # bincount, not np.unique (its first call imports numpy.ma: key_table.distinct)
        for m in np.flatnonzero(np.bincount(med.astype(np.intp), minlength=1)).tolist():
            sel = med == m
            self._fold_medium(int(m), keys[sel], metas[sel])

    def _fold_medium(self, medium: int, keys: np.ndarray, metas: np.ndarray) -> None:
        t = self._tables.get(medium)
        if t is None:
            t = self._tables[medium] = self._table()
        # One lookup per record (a repeated key gets its one position), no sort: the records of
        # positions seen once in this batch are their own last op; only positions that repeat
        # (usually few) are ordered and reduced (fold_ops on positions). Repeats are found by a
        # scatter and read-back of record indexes: one of each repeated position's records
        # reads back its own index, the others do not.
        pos = t.find(keys)
        accel = compiled.accel
        if accel is not None:  # the records in order, in one C pass: no repeats to find
            accel.apply(pos, np.ascontiguousarray(metas, np.uint64), t.cols["masks"])
            return
        n = len(pos)
        at = np.arange(n)
        mark = np.empty(t.n, np.int64)
        mark[pos] = at
        lost = mark[pos] != at
        if lost.any():
            repeated = np.zeros(t.n, np.bool_)
            repeated[pos[lost]] = True
            run = repeated[pos]
            lone = ~run
            p_r, set_r, clr_r = fold_ops(pos[run], metas[run])
            p_l, set_l, clr_l = _bits(pos[lone], metas[lone])
            pos = np.concatenate([p_l, p_r])
            set_m = np.concatenate([set_l, set_r])
            clr_m = np.concatenate([clr_l, clr_r])
        else:
            pos, set_m, clr_m = _bits(pos, metas)
        masks = t.cols["masks"]
        m = masks[pos].astype(np.int64)
        masks[pos] = ((m & ~clr_m) | set_m).astype(np.uint32)

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident (key, medium) pairs as of the last fold. Never folds: it is read from threads
        that do not hold the hook's flush token (stats()), and only its holder may fold."""
        tables = list(self._tables.values())  # a snapshot: the flush thread may swap the dict
        return sum(int(np.count_nonzero(t.cols["masks"][: t.n])) for t in tables)

    def export(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, masks, medium indexes) as of every record applied; mask 0 = not held."""
        self._fold()
        if len(self._tables) == 1 and 0 in self._tables:
            n = self._t.n
            return self._t.keys[:n].copy(), self._t.cols["masks"][:n].copy(), np.zeros(n, np.uint8)
        items = sorted(self._tables.items())
        keys = np.concatenate([t.keys[: t.n] for _, t in items])
        masks = np.concatenate([t.cols["masks"][: t.n] for _, t in items])
        mediums = np.concatenate([np.full(t.n, m, np.uint8) for m, t in items])
        return keys, masks, mediums

    def as_dict(self) -> dict[tuple[int, int], int]:
        """(key, medium index) -> group mask of every held pair."""
        keys, masks, mediums = self.export()
        held = masks != 0
        pairs = zip(keys[held].tolist(), mediums[held].tolist(), strict=True)
        return dict(zip(pairs, masks[held].tolist(), strict=True))
