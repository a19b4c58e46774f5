"""Store counts per (key, medium, group): vLLM stores equal hashes once per physical block.

Imports: numpy, sidecar.shm_ring (KeyTable), key_state. A key is held in a (medium, group) while
its count is positive; a remove of a count at 0 changes nothing (the count never goes negative:
after a forget the sidecar sees removes of blocks stored before it). Folding a batch is
vectorised: per (key, medium, group), in arrival order, the clamped walk c <- max(0, c + d) ends
at P - min(-c0, min_k P_k) (P_k the prefix sums of d); only keys whose held state flips reach the
key state, as group bits to set or clear.
"""

from __future__ import annotations

import numpy as np

from sidecar.key_state import KeyState
from sidecar.shm_ring.key_table import KeyTable

_MIN_CAP = 1 << 14


class BlockCounts:
    def __init__(self, keys: KeyState) -> None:
        self.keys = keys
        self.tables: dict[tuple[int, int], KeyTable] = {}  # (medium, group) -> counts

    def _table(self, medium: int, group: int) -> KeyTable:
        t = self.tables.get((medium, group))
        if t is None:
            t = self.tables[(medium, group)] = KeyTable(
                {"count": np.int64}, live=("count",), min_capacity=_MIN_CAP
            )
        return t

    def held(self) -> int:
        """(key, medium, group)s with a positive count."""
        return sum(int((t.cols["count"][: t.n] > 0).sum()) for t in self.tables.values())

    def counts(self) -> dict[tuple[int, int, int], int]:
        """(key, medium, group) -> count of every positive count (tests, checkpoints)."""
        out: dict[tuple[int, int, int], int] = {}
        for (m, g), t in self.tables.items():
            c = t.cols["count"][: t.n]
            pos = np.flatnonzero(c > 0)
            for k, n in zip(t.keys[pos].tolist(), c[pos].tolist(), strict=True):
                out[(k, m, g)] = n
        return out

    def arrays(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """(medium, group, keys, counts) of the positive counts, per table (checkpoints)."""
        out = []
        for (m, g), t in sorted(self.tables.items()):
            c = t.cols["count"][: t.n]
            pos = np.flatnonzero(c > 0)
            out.append((m, g, t.keys[pos].copy(), c[pos].copy()))
        return out

    def clear(self) -> None:
        """Every count to 0 (AllBlocksCleared, a forget); the key state empties too."""
        self.tables = {}
        self.keys.clear_current()

    def load(self, medium: int, group: int, keys: np.ndarray, counts: np.ndarray) -> None:
        """Add distinct keys with positive counts (a checkpoint being restored)."""
        t = self._table(medium, group)
        pos = t.find(keys, True)
        old = t.cols["count"][pos]
        new = old + counts
        t.cols["count"][pos] = new
        flip = (old <= 0) & (new > 0)
        bits = np.full(int(flip.sum()), 1 << group, np.int64)
        self.keys.apply_bits(medium, keys[flip], bits, np.zeros_like(bits))

    def apply(
        self, keys: np.ndarray, mediums: np.ndarray, groups: np.ndarray, signs: np.ndarray
    ) -> None:
        """Fold block events (one per hash, in arrival order, no clears among them)."""
        if not len(keys):
            return
        if mediums.any() or groups.any():
            place = mediums.astype(np.int64) << 8 | groups.astype(np.int64)
            for p in np.unique(place).tolist():
                sel = place == p
                self._apply_one(p >> 8, p & 0xFF, keys[sel], signs[sel])
            return
        self._apply_one(0, 0, keys, signs)

    def _apply_one(self, medium: int, group: int, keys: np.ndarray, signs: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")  # by key, arrival order kept within a key
        k = keys[order]
        d = signs[order].astype(np.int64)
        first = np.ones(len(k), np.bool_)
        first[1:] = k[1:] != k[:-1]
        idx = np.flatnonzero(first)
        ukeys = k[idx]
        csum = np.cumsum(d)
        before = np.zeros(len(idx), np.int64)  # the running sum just before each key's run
        before[1:] = csum[idx[1:] - 1]
        prefix = csum - np.repeat(before, np.diff(np.append(idx, len(k))))
        total = prefix[np.append(idx[1:], len(k)) - 1]
        low = np.minimum.reduceat(prefix, idx)
        t = self._table(medium, group)
        pos = t.find(ukeys, True)
        c0 = t.cols["count"][pos]
        c1 = total - np.minimum(-c0, low)
        t.cols["count"][pos] = c1
        was, now = c0 > 0, c1 > 0
        flip = was != now
        if not flip.any():
            return
        bit = np.int64(1 << group)
        fk, fnow = ukeys[flip], now[flip]
        set_m = np.where(fnow, bit, np.int64(0))
        clr_m = np.where(fnow, np.int64(0), bit)
        self.keys.apply_bits(medium, fk, set_m, clr_m)
