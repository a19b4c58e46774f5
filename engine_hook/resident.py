"""The hook's own record of resident (key, group) pairs, for engines that cannot enumerate theirs.

Imports: numpy + sidecar.shm_ring.layout. Block metadata lives in arrays (DESIGN §5): an
open-addressing hash table (linear probing; a removed key keeps its slot with mask 0) updated in
bulk. Records are queued as they are published and folded into the table when the queue is long
or a snapshot is asked for, so `export()` is exactly the fold of every record applied so far (the
snapshot fence) and costs one vectorised filter over the table. Not thread-safe: the hook calls
apply/export only under its flush lock.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sidecar.shm_ring.layout import KIND_CLEARED, KIND_REMOVED, KIND_STORED

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
FOLD_AT = 1 << 16  # queued records before a fold: amortises numpy's fixed per-call cost


def fold_ops(keys: np.ndarray, metas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Last op per (key, group) wins -> (distinct keys, group bits set, group bits cleared).

    `metas` must hold stored/removed records only (a clear is handled by the caller).
    """
    n = len(keys)
    groups = ((metas >> np.uint64(8)) & np.uint64(0xFF)).astype(np.int64)
    kinds = (metas & np.uint64(0xFF)).astype(np.uint8)
    order = np.lexsort((np.arange(n), groups, keys))
    k_s, g_s, kind_s = keys[order], groups[order], kinds[order]
    last = np.ones(n, np.bool_)
    last[:-1] = (k_s[1:] != k_s[:-1]) | (g_s[1:] != g_s[:-1])
    k_s, g_s, kind_s = k_s[last], g_s[last], kind_s[last]
    bits = np.left_shift(np.int64(1), g_s)
    setb = np.where(kind_s == KIND_STORED, bits, 0)
    clrb = np.where(kind_s == KIND_REMOVED, bits, 0)
    first = np.ones(len(k_s), np.bool_)
    first[1:] = k_s[1:] != k_s[:-1]
    idx = np.flatnonzero(first)
    if not len(idx):
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    return k_s[idx], np.bitwise_or.reduceat(setb, idx), np.bitwise_or.reduceat(clrb, idx)


class ResidentSet:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self._alloc(capacity)
        self._queue_k: list[np.ndarray] = []
        self._queue_m: list[np.ndarray] = []
        self._queued = 0

    def _alloc(self, capacity: int) -> None:
        self._cap = capacity
        self._bits = capacity.bit_length() - 1
        self._keys = np.zeros(capacity, np.int64)
        self._masks = np.zeros(capacity, np.uint32)
        self._used = np.zeros(capacity, np.bool_)
        self._n_used = 0

    # ---- recording ------------------------------------------------------------------------
    def apply(self, keys: np.ndarray, metas: np.ndarray) -> None:
        if not len(keys):
            return
        self._queue_k.append(np.array(keys, np.int64))
        self._queue_m.append(np.array(metas, np.uint64))
        self._queued += len(keys)
        if self._queued >= FOLD_AT:
            self._fold()

    def apply_pairs(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if pairs:
            keys = [k - (1 << 64) if k >= 1 << 63 else k for k, _ in pairs]
            self.apply(np.array(keys, np.int64), np.array([m for _, m in pairs], np.uint64))

    def _fold(self) -> None:
        if not self._queued:
            return
        keys = np.concatenate(self._queue_k)
        metas = np.concatenate(self._queue_m)
        self._queue_k, self._queue_m, self._queued = [], [], 0
        kinds = metas & np.uint64(0xFF)
        start = 0
        for c in np.flatnonzero(kinds == KIND_CLEARED).tolist():
            self._fold_segment(keys[start:c], metas[start:c])
            self._masks[:] = 0  # everything gone; the keys stay as reusable slots
            start = c + 1
        self._fold_segment(keys[start:], metas[start:])

    def _fold_segment(self, keys: np.ndarray, metas: np.ndarray) -> None:
        if not len(keys):
            return
        ukeys, set_m, clr_m = fold_ops(keys, metas)
        slots = self._slots(ukeys)
        m = self._masks[slots].astype(np.int64)
        self._masks[slots] = ((m & ~clr_m) | set_m).astype(np.uint32)

    # ---- the table ------------------------------------------------------------------------
    def _hash(self, keys: np.ndarray) -> np.ndarray:
        h = (keys.view(np.uint64) * _GOLDEN) >> np.uint64(64 - self._bits)
        return h.astype(np.int64)

    def _slots(self, ukeys: np.ndarray) -> np.ndarray:
        """Slot of each distinct key, inserting the missing ones (vectorised linear probing)."""
        if (self._n_used + len(ukeys)) * 10 > self._cap * 7:  # linear probing stays short at 70 %
            self._rebuild(len(ukeys))
        mask = self._cap - 1
        idx = self._hash(ukeys)
        out = np.empty(len(ukeys), np.int64)
        todo = np.arange(len(ukeys))
        while len(todo):
            s = idx[todo]
            used = self._used[s]
            done = used & (self._keys[s] == ukeys[todo])
            out[todo[done]] = s[done]
            free = np.flatnonzero(~used)
            if len(free):
                # Several keys may reach the same empty slot: the first claims it, the others
                # find it taken and probe on.
                claim_s, first = np.unique(s[free], return_index=True)
                winners = todo[free[first]]
                self._used[claim_s] = True
                self._keys[claim_s] = ukeys[winners]
                self._masks[claim_s] = 0
                self._n_used += len(claim_s)
                out[winners] = claim_s
                done[free[first]] = True
            todo = todo[~done]
            idx[todo] = (idx[todo] + 1) & mask
        return out

    def _rebuild(self, incoming: int) -> None:
        """Grow (or compact away removed keys): rehash the live entries into a fresh table."""
        live = self._masks != 0
        keys, masks = self._keys[live], self._masks[live]
        cap = 1 << 16
        while cap < (len(keys) + incoming) * 2:  # rebuilt table at most half full
            cap *= 2
        self._alloc(cap)
        if len(keys):
            self._masks[self._slots(keys)] = masks

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident keys as of the last fold. Never folds: it is read from threads that do not
        hold the hook's flush lock (stats()), and only that lock's holder may fold."""
        return int(np.count_nonzero(self._masks))

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        self._fold()
        live = self._masks != 0
        return self._keys[live], self._masks[live]

    def as_dict(self) -> dict[int, int]:
        keys, masks = self.export()
        return dict(zip(keys.tolist(), masks.tolist(), strict=True))
