"""A vectorised hash index from 64-bit block keys to dense positions 0, 1, 2, ... .

Imports: numpy only. Shared by the engine's resident set and the sidecar's key state, which keep
their per-key columns (group masks, acked, queued) in arrays indexed by these positions.
Open addressing with linear probing; a key never leaves the index (callers compact by building a
fresh one from the keys they keep). The probe loop runs in C (_accel.c, one pass, ~8x faster
than numpy's rounds) when the extension was built, else in the numpy rounds below; both give
every key the same position set, a new key the next free position.
"""

from __future__ import annotations

import numpy as np

from sidecar.shm_ring import compiled

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SMALL = 1 << 20  # slots
# Keys still probing when this few are left go on in windows of _WINDOW slots per numpy round:
# in a half-full table some probe runs are 20+ slots long, and a round per slot for the last
# few keys cost a third of a lookup (~20 numpy calls per round, whatever the keys left).
_TAIL = 512
_WINDOW = 16


def fit(column: np.ndarray, size: int) -> np.ndarray:
    """`column` if it holds `size` entries, else a zero-filled copy with room to grow."""
    if size <= len(column):
        return column
    out = np.zeros(max(size, 2 * len(column)), column.dtype)
    out[: len(column)] = column
    return out


def sized_for(count: int, minimum: int) -> int:
    """Index capacity (a power of two) for `count` keys at most half full; below SMALL slots
    at most a quarter full, so a table growing from empty is rebuilt half as often (each
    rebuild re-inserts every live key) for at most SMALL * 16 bytes more memory."""
    cap = minimum
    while cap < count * (4 if cap < SMALL else 2):
        cap *= 2
    return cap


class IndexFull(Exception):
    """A lookup would probe a full index forever (its owner must re-index before it fills)."""


class KeyIndex:
    def __init__(self, capacity: int) -> None:
        self.cap = capacity
        self._bits = capacity.bit_length() - 1
        self._tkeys = np.zeros(capacity, np.int64)
        # Dense position + 1; 0 = empty slot. Zeros come from calloc: a big table's pages are
        # faulted in as slots are used, not all at once when it is created.
        self._tpos = np.zeros(capacity, np.int64)
        # Dense: the key at each position. Room for all the index may hold before it is crowded
        # (pages are faulted in as positions are used), so it never grows by copying.
        self.keys = np.zeros(capacity * 7 // 10 + 1, np.int64)
        self.n = 0

    def insert_absent(self, ukeys: np.ndarray) -> None:
        """Insert distinct keys known to be absent, at positions n, n+1, ... in their order.

        What a rebuild does chunk by chunk: with positions known in advance, moving the owner's
        per-key columns is a gather into a contiguous range instead of a scatter.
        """
        base, m = self.n, len(ukeys)
        self.keys = fit(self.keys, base + m)
        if compiled.accel is not None:
            self._c_find(np.ascontiguousarray(ukeys, np.int64), True)
            return
        self.keys[base : base + m] = ukeys
        mask = self.cap - 1
        slot = self._home(ukeys)
        todo = np.arange(m)
        while len(todo):
            s = slot[todo]
            free = self._tpos[s] == 0
            fs, cand = s[free], todo[free]
            self._tpos[fs] = -1 - cand  # one mark per contested slot survives
            won = self._tpos[fs] == -1 - cand
            self._tpos[fs[won]] = base + cand[won] + 1
            self._tkeys[fs[won]] = ukeys[cand[won]]
            placed = np.zeros(len(todo), np.bool_)
            placed[np.flatnonzero(free)[won]] = True
            todo = todo[~placed]
            slot[todo] = (slot[todo] + 1) & mask
        self.n = base + m

    def _home(self, ukeys: np.ndarray) -> np.ndarray:
        home: np.ndarray = ((ukeys.view(np.uint64) * _GOLDEN) >> np.uint64(64 - self._bits)).astype(
            np.int64
        )
        return home

    def crowded(self, incoming: int) -> bool:
        """Would `incoming` new keys push the index past 70 % (where probing gets long)?"""
        return (self.n + incoming) * 10 > self.cap * 7

    def find(self, ukeys: np.ndarray, insert: bool = True) -> np.ndarray:
        """Position of each key; missing ones get n, n+1, ... (or -1 if not inserting). A key
        may repeat: its copies probe in step, one claims the slot, the others find it there."""
        if insert:
            self.keys = fit(self.keys, self.n + len(ukeys))
        if compiled.accel is not None:
            return self._c_find(np.ascontiguousarray(ukeys, np.int64), insert)
        mask = self.cap - 1
        idx = self._home(ukeys)
        out = np.full(len(ukeys), -1, np.int64)
        todo = np.arange(len(ukeys))
        while len(todo):
            if self.n >= self.cap:  # no empty slot left: a probe would never end
                raise IndexFull(f"{self.n} keys in {self.cap} slots")
            if len(todo) <= _TAIL:
                self._find_tail(ukeys, todo, idx, out, insert)
                break
            s = idx[todo]
            pos = self._tpos[s]
            used = pos > 0
            done = used & (self._tkeys[s] == ukeys[todo])
            out[todo[done]] = pos[done] - 1
            free = np.flatnonzero(~used)
            if len(free):
                if insert:
                    cand = todo[free]
                    won = self._claim(s[free], cand, ukeys, out)
                    done[free[won]] = True
                    # The others look at that slot again (it may now hold their own key, a
                    # copy's): undo the step every key still probing takes below.
                    idx[cand[~won]] -= 1
                else:
                    done[free] = True  # an empty slot ends the probe: absent
            todo = todo[~done]
            idx[todo] = (idx[todo] + 1) & mask
        return out

    def _c_find(self, ukeys: np.ndarray, insert: bool) -> np.ndarray:
        accel = compiled.accel
        assert accel is not None
        out = np.empty(len(ukeys), np.int64)
        n = accel.find(ukeys, self._tkeys, self._tpos, self.keys, out, self.n, insert)
        if n < 0:  # full: the keys before the one that found no slot are in
            self.n = -1 - n
            raise IndexFull(f"{self.n} keys in {self.cap} slots")
        self.n = n
        return out

    def _claim(
        self, slots: np.ndarray, cand: np.ndarray, ukeys: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        """Keys `cand` (indexes into ukeys) take the empty `slots` they reached; which won.

        Several keys may reach the same empty slot: each writes its mark there, one mark
        survives (no sort needed), its key claims the slot and gets the next position; the
        others find the slot taken (maybe by a copy of their own key) when they look again."""
        self._tpos[slots] = -2 - cand
        won: np.ndarray = self._tpos[slots] == -2 - cand
        winners, claim_s = cand[won], slots[won]
        new_pos = np.arange(self.n, self.n + len(winners))
        self._tpos[claim_s] = new_pos + 1
        self._tkeys[claim_s] = ukeys[winners]
        self.keys[new_pos] = ukeys[winners]
        self.n += len(winners)
        out[winners] = new_pos
        return won

    def _find_tail(
        self, ukeys: np.ndarray, todo: np.ndarray, at: np.ndarray, out: np.ndarray, insert: bool
    ) -> None:
        """find() for the few keys left (`todo`, probing on from `at`), a window per round."""
        mask = self.cap - 1
        steps = np.arange(_WINDOW)
        while len(todo):
            if self.n >= self.cap:
                raise IndexFull(f"{self.n} keys in {self.cap} slots")
            win = (at[todo][:, None] + steps) & mask
            wpos = self._tpos[win]
            stop = (wpos == 0) | (self._tkeys[win] == ukeys[todo][:, None]) & (wpos > 0)
            ended = stop.any(axis=1)
            rows = np.flatnonzero(ended)
            off = stop[rows].argmax(axis=1)  # the first slot that ends each probe
            slot, pos = win[rows, off], wpos[rows, off]
            found = pos > 0
            out[todo[rows[found]]] = pos[found] - 1
            done = np.zeros(len(todo), np.bool_)
            done[rows[found]] = True
            empty, cand = slot[~found], todo[rows[~found]]
            if insert and len(cand):
                won = self._claim(empty, cand, ukeys, out)
                done[rows[~found][won]] = True
                at[cand[~won]] = empty[~won]  # the others probe on from that slot
            elif len(cand):
                done[rows[~found]] = True  # an empty slot ends the probe: absent
            rest = todo[~ended]
            at[rest] = (at[rest] + _WINDOW) & mask
            todo = todo[~done]
