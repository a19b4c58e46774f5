"""The hook's own record of resident (key, group) pairs, for engines that cannot enumerate theirs.

Imports: numpy + sidecar.shm_ring.layout. Block metadata lives in arrays (DESIGN §5): dense
(key, mask) arrays indexed by an open-addressing hash table (linear probing), updated in bulk.
Records are queued as they are published and folded in when the queue is long or a snapshot is
asked for, so `export()` is exactly the fold of every record applied so far (the snapshot fence)
and costs two slice copies. Not thread-safe: the hook calls apply/export only under its flush lock.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sidecar.shm_ring.fold import fold_ops
from sidecar.shm_ring.layout import KIND_CLEARED

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
FOLD_AT = 1 << 16  # queued records before a fold: amortises numpy's fixed per-call cost


class ResidentSet:
    """key -> group mask: a dense (key, mask) array in insertion order plus a hash index.

    A removed key keeps its dense entry with mask 0 until the next compaction, so `export()` is
    two slice copies (the snapshot format treats mask-0 entries as "not held").
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._alloc(capacity)
        self._queue_k: list[np.ndarray] = []
        self._queue_m: list[np.ndarray] = []
        self._queued = 0

    def _alloc(self, capacity: int) -> None:
        self._cap = capacity  # hash index slots, a power of two
        self._bits = capacity.bit_length() - 1
        self._tkeys = np.zeros(capacity, np.int64)
        self._tpos = np.full(capacity, -1, np.int64)  # dense position, -1 = empty slot
        self._dkeys = np.zeros(capacity // 2 + 1, np.int64)
        self._dmasks = np.zeros(capacity // 2 + 1, np.uint32)
        self._n = 0  # dense entries in use (live + removed-but-not-compacted)

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
            self._alloc(1 << 16)  # everything gone
            start = c + 1
        self._fold_segment(keys[start:], metas[start:])

    def _fold_segment(self, keys: np.ndarray, metas: np.ndarray) -> None:
        if not len(keys):
            return
        ukeys, set_m, clr_m = fold_ops(keys, metas)
        pos = self._positions(ukeys)
        m = self._dmasks[pos].astype(np.int64)
        self._dmasks[pos] = ((m & ~clr_m) | set_m).astype(np.uint32)

    # ---- the index ------------------------------------------------------------------------
    def _hash(self, keys: np.ndarray) -> np.ndarray:
        h = (keys.view(np.uint64) * _GOLDEN) >> np.uint64(64 - self._bits)
        return h.astype(np.int64)

    def _positions(self, ukeys: np.ndarray) -> np.ndarray:
        """Dense position of each distinct key, appending the missing ones (linear probing)."""
        if (self._n + len(ukeys)) * 10 > self._cap * 7:  # probing stays short below 70 %
            self._rebuild(len(ukeys))
        if self._n + len(ukeys) > len(self._dkeys):
            size = max(self._n + len(ukeys), 2 * len(self._dkeys))
            self._dkeys = np.resize(self._dkeys, size)
            self._dmasks = np.resize(self._dmasks, size)
        mask = self._cap - 1
        idx = self._hash(ukeys)
        out = np.empty(len(ukeys), np.int64)
        todo = np.arange(len(ukeys))
        while len(todo):
            s = idx[todo]
            pos = self._tpos[s]
            used = pos >= 0
            done = used & (self._tkeys[s] == ukeys[todo])
            out[todo[done]] = pos[done]
            free = np.flatnonzero(~used)
            if len(free):
                # Several keys may reach the same empty slot: the first claims it, the others
                # find it taken and probe on.
                claim_s, first = np.unique(s[free], return_index=True)
                winners = todo[free[first]]
                new_pos = np.arange(self._n, self._n + len(winners))
                self._tpos[claim_s] = new_pos
                self._tkeys[claim_s] = ukeys[winners]
                self._dkeys[new_pos] = ukeys[winners]
                self._dmasks[new_pos] = 0
                self._n += len(winners)
                out[winners] = new_pos
                done[free[first]] = True
            todo = todo[~done]
            idx[todo] = (idx[todo] + 1) & mask
        return out

    def _rebuild(self, incoming: int) -> None:
        """Grow, and compact away removed keys: re-index the live entries in a fresh table."""
        n = self._n
        live = self._dmasks[:n] != 0
        keys, masks = self._dkeys[:n][live], self._dmasks[:n][live]
        cap = 1 << 16
        while cap < (len(keys) + incoming) * 2:  # the fresh index at most half full
            cap *= 2
        self._alloc(cap)
        if len(keys):
            self._dmasks[self._positions(keys)] = masks

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident keys as of the last fold. Never folds: it is read from threads that do not
        hold the hook's flush lock (stats()), and only that lock's holder may fold."""
        return int(np.count_nonzero(self._dmasks[: self._n]))

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, masks) as of every record applied; mask-0 entries are keys not held."""
        self._fold()
        return self._dkeys[: self._n].copy(), self._dmasks[: self._n].copy()

    def as_dict(self) -> dict[int, int]:
        keys, masks = self.export()
        held = masks != 0
        return dict(zip(keys[held].tolist(), masks[held].tolist(), strict=True))
