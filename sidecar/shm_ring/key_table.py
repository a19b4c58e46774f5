"""Per-key columns behind a KeyIndex, re-indexed in bounded steps.

Imports: numpy + key_index. Shared by the sidecar's key state and the engine hook's resident set:
both keep dense numpy columns indexed by a key's position, and both must drop dead keys and grow
without a long pause (the sidecar's event loop, the engine's flush).

Re-indexing starts when the index is REBUILD_AT full and is done a bounded piece per insert
call: first the new arrays' pages are touched, FAULT_STEP_BYTES per call (a page fault costs
~5 us on a VM, and a fresh hash table faults on nearly every random write), then REBUILD_STEP
keys move per call (~2-3 ms each), then one switch moves the columns (~17 ms at 580 k keys, where
a one-shot rebuild held the caller ~100 ms). It completes at once only if the old index reaches
70 % first. Keys live when the rebuild started keep their order; keys inserted or revived
meanwhile follow them.

Every column is zero at positions >= n: columns are born zeroed (np.zeros, fit's zero-filled
copy, the rebuild's arrays, into which _switch writes positions < the new n only), they are
replaced only here, and their writers touch positions find/locate returned or [:n] slices. So a
new position's entries are zero without a write, and find() does nothing to the columns unless
they must grow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from sidecar.shm_ring.key_index import KeyIndex, fit, sized_for

REBUILD_AT = 0.55
REBUILD_STEP = 8_192
FAULT_STEP_BYTES = 2 << 20
_PAGE = 4096
Mover = Callable[[np.ndarray], np.ndarray]  # old dense positions (all live) -> new ones


def distinct(keys: np.ndarray) -> int:
    """How many distinct keys: a sort, not np.unique, whose first call imports numpy.ma (10-30
    ms holding the GIL: inside an engine's flush)."""
    if len(keys) < 2:
        return len(keys)
    s = np.sort(keys)
    return 1 + int(np.count_nonzero(s[1:] != s[:-1]))


class _Rebuild:
    """A fresh index being filled with the keys that were live when it started."""

    __slots__ = ("cols", "idx", "kept", "work")

    def __init__(self, idx: KeyIndex, kept: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        self.idx = idx
        self.kept = kept  # old dense positions, ascending; kept[i] moves to new position i
        self.cols = cols  # the new columns, zeroed
        self.work: Iterator[None] = iter(())


class KeyTable:
    """Dense columns (name -> dtype) per key; a key is live while any `live` column is nonzero."""

    def __init__(
        self, columns: dict[str, type], live: tuple[str, ...], min_capacity: int = 1 << 12
    ) -> None:
        self.min_capacity = min_capacity
        self.live_columns = live
        self.epoch = 0  # dense positions change when the index is replaced
        self.idx = KeyIndex(min_capacity)
        self.cols: dict[str, np.ndarray] = {
            name: np.zeros(len(self.idx.keys), dt) for name, dt in columns.items()
        }
        self._room = len(self.idx.keys)  # positions every column holds
        self.rebuild: _Rebuild | None = None
        self.on_move: Callable[[Mover], None] | None = None  # owners holding positions

    @property
    def room(self) -> int:
        """Positions every column holds (find() grows them past it; a C fold must not)."""
        return self._room

    def add_column(self, name: str, dtype: type, live: bool = True) -> np.ndarray:
        """A new zeroed column (also in a re-index under way); `live`: nonzero keeps a key."""
        self.cols[name] = np.zeros(self._room, dtype)
        if self.rebuild is not None:
            self.rebuild.cols[name] = np.zeros(len(self.rebuild.idx.keys), dtype)
        if live:
            self.live_columns = (*self.live_columns, name)
        return self.cols[name]

    @property
    def n(self) -> int:
        return self.idx.n

    @property
    def keys(self) -> np.ndarray:
        return self.idx.keys

    def live(self) -> np.ndarray:
        """Positions of live keys, ascending."""
        n = self.n
        mask = np.zeros(n, np.bool_)
        for name in self.live_columns:
            mask |= self.cols[name][:n] != 0
        out: np.ndarray = np.flatnonzero(mask)
        return out

    def find(self, ukeys: np.ndarray, insert: bool = True) -> np.ndarray:
        """Dense position of each key (repeats allowed); new ones get zeroed columns (or -1 if
        not inserting). How many keys may be new paces and sizes the re-index: all of them,
        unless the index could not take that many; then the distinct ones, counted exactly (a
        repeat is no new key: counted as one it would finish a re-index in one call, or start
        one needlessly; an estimate that counts too few would let the index fill)."""
        idx = self.idx
        if not insert:
            return idx.find(ukeys, insert=False)
        incoming = len(ukeys)
        if self.rebuild is not None or idx.n + incoming > idx.cap * REBUILD_AT:
            if idx.crowded(incoming):  # (past 70 % only beyond REBUILD_AT)
                incoming = distinct(ukeys)
            self._reindex_step(incoming)
            idx = self.idx
        pos = idx.find(ukeys)
        if idx.n > self._room:  # new positions' entries are zero already (see above)
            self._fit(idx.n)
        return pos

    def _fit(self, size: int) -> None:
        """Every column to at least `size` entries (fit: a zero-filled copy, twice as long)."""
        cols = self.cols
        for name, col in cols.items():
            cols[name] = fit(col, size)
        self._room = min(len(c) for c in cols.values())

    def locate(self, ukeys: np.ndarray) -> np.ndarray:
        """find(insert=True) for keys that are usually all present (a commit of what was sent):
        a plain lookup, inserting only if one is missing. find() paces the re-index as if every
        key were new, so a commit of 30 000 held keys would rebuild the whole table for none."""
        pos = self.idx.find(ukeys, insert=False)
        if len(pos) and int(pos.min()) < 0:
            pos = self.find(ukeys, insert=True)  # may re-index: every position looked up again
        return pos

    # ---- re-indexing ----------------------------------------------------------------------
    def _reindex_step(self, incoming: int) -> None:
        """Start, advance or finish the re-index, so that `incoming` keys can be inserted."""
        while True:
            idx, rb = self.idx, self.rebuild
            if rb is None:
                if idx.n + incoming <= idx.cap * REBUILD_AT:
                    return
                rb = self.rebuild = self._start(incoming)
            finish = idx.crowded(incoming)  # the old index cannot take them: finish now
            for _ in rb.work:
                if not finish:
                    return
            self._switch(rb)
            if not self.idx.crowded(incoming):
                return
            # Keys inserted while it was built filled the new index: go round again.

    def _start(self, incoming: int) -> _Rebuild:
        kept = self.live()
        new = KeyIndex(sized_for(len(kept) + incoming, self.min_capacity))
        cols = {name: np.zeros(len(new.keys), c.dtype) for name, c in self.cols.items()}
        rb = _Rebuild(new, kept, cols)
        rb.work = self._work(rb)
        return rb

    def _work(self, rb: _Rebuild) -> Iterator[None]:
        """The rebuild, yielding after each bounded piece."""
        budget = FAULT_STEP_BYTES
        dense = len(rb.kept) + REBUILD_STEP  # the rest fills in order, faulting as it goes
        arrays = [rb.idx._tkeys, rb.idx._tpos, rb.idx.keys[:dense]]
        arrays += [c[:dense] for c in rb.cols.values()]
        for arr in arrays:
            flat = arr.view(np.uint8)
            for at in range(0, len(flat), _PAGE * 256):
                flat[at : at + _PAGE * 256 : _PAGE] = 0  # one write per page: its fault
                budget -= _PAGE * 256
                if budget <= 0:
                    budget = FAULT_STEP_BYTES
                    yield
        yield
        for at in range(0, len(rb.kept), REBUILD_STEP):
            rb.idx.insert_absent(self.keys[rb.kept[at : at + REBUILD_STEP]])
            yield

    def _switch(self, rb: _Rebuild) -> None:
        """Adopt the rebuilt index: keys that became live meanwhile join it, columns move."""
        self.rebuild = None
        kept, k = rb.kept, len(rb.kept)
        live = self.live()
        n0 = int(kept[-1]) + 1 if k else 0
        low = live[: np.searchsorted(live, n0)]
        if np.array_equal(low, kept):  # the usual case: nothing below n0 came back to life
            missing = live[len(low) :]
        else:
            was_kept = np.zeros(self.n, np.bool_)
            was_kept[kept] = True
            missing = live[~was_kept[live]]  # inserted, or revived, since the rebuild started
        rb.idx.insert_absent(self.keys[missing])  # positions k, k+1, ...
        for name, old in self.cols.items():
            col = self.cols[name] = fit(rb.cols[name], len(rb.idx.keys))
            col[:k] = old[kept]
            col[k : k + len(missing)] = old[missing]
        self._room = min(len(c) for c in self.cols.values())
        self.idx = rb.idx
        self.epoch += 1
        if self.on_move is not None:
            self.on_move(self._mover(kept, missing))

    def _mover(self, kept: np.ndarray, missing: np.ndarray) -> Mover:
        """Old live positions -> new: kept[i] -> i, missing[j] -> len(kept) + j."""
        k = len(kept)
        n = int(max(kept[-1] if k else -1, missing[-1] if len(missing) else -1)) + 1
        remap: np.ndarray | None = None

        def moved(q: np.ndarray) -> np.ndarray:
            nonlocal remap
            if remap is None and len(q) * 16 > n:  # many to move: one table beats searching
                remap = np.empty(n, np.int64)
                remap[kept] = np.arange(k)
                remap[missing] = np.arange(k, k + len(missing))
            if remap is not None:
                out: np.ndarray = remap[q]
                return out
            i = np.searchsorted(kept, q)  # both lists are sorted
            hit = (kept[np.minimum(i, k - 1)] == q) & (i < k) if k else np.zeros(len(q), bool)
            out = np.where(hit, i, k + np.searchsorted(missing, q))
            return out

        return moved
