"""What is published, what KVCM has confirmed, and the difference between them.

Imports: stdlib + numpy + sidecar.shm_ring.layout. `current` maps each key to the cache groups
that hold it (from the ring and engine snapshots); a key is published when every required group
holds it. `acked` is what KVCM confirmed. `dirty` holds keys whose published state may differ from
`acked`, in first-seen order; sending is always "make KVCM's copy equal to current", so retries
are idempotent and per-key coalescing (last state wins) comes for free.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sidecar.shm_ring.layout import KIND_CLEARED, KIND_REMOVED, KIND_STORED

_SIGN = 1 << 63
_WRAP = 1 << 64


class KeyState:
    def __init__(self, required_groups: Iterable[int] = (0,)) -> None:
        self.required = sum(1 << g for g in set(required_groups)) or 1
        self.current: dict[int, int] = {}
        self.acked: set[int] = set()
        self.dirty: dict[int, None] = {}
        self.published_count = 0

    def set_required(self, required_groups: Iterable[int]) -> None:
        req = sum(1 << g for g in set(required_groups)) or 1
        if req != self.required:
            self.required = req
            self._recount()

    def is_published(self, key: int) -> bool:
        return self.current.get(key, 0) & self.required == self.required

    # ---- engine side --------------------------------------------------------------------
    def apply(self, records: np.ndarray) -> None:
        """Fold ring records ((n, 4) uint64 rows: seq, key, meta, parent) into `current`."""
        if not len(records):
            return
        cur = self.current
        get = cur.get
        req = self.required
        dirty = self.dirty
        npub = self.published_count
        for key, meta in records[:, 1:3].tolist():
            if key >= _SIGN:
                key -= _WRAP
            kind = meta & 0xFF
            if kind == KIND_CLEARED:
                self.published_count = npub
                self._clear()
                npub = 0
                continue
            old = get(key, 0)
            bit = 1 << ((meta >> 8) & 0xFF)
            new = old | bit if kind == KIND_STORED else old & ~bit if kind == KIND_REMOVED else old
            if new == old:
                continue  # repeated stores and unknown kinds change nothing
            if new:
                cur[key] = new
            else:
                del cur[key]
            was = old & req == req
            now = new & req == req
            if was != now:
                npub += 1 if now else -1
                dirty[key] = None
        self.published_count = npub

    def _clear(self) -> None:
        req = self.required
        for k, m in self.current.items():
            if m & req == req:
                self.dirty[k] = None
        self.current.clear()
        self.published_count = 0

    def clear_current(self) -> None:
        """The engine's cache is empty (a new engine incarnation)."""
        self._clear()

    def replace(self, keys: np.ndarray, masks: np.ndarray) -> None:
        """Replace `current` with an engine snapshot; a key may repeat with different bits."""
        new: dict[int, int] = {}
        get = new.get
        for k, m in zip(keys.tolist(), masks.tolist(), strict=True):
            new[k] = get(k, 0) | m
        req = self.required
        old = self.current
        for k, m in old.items():
            if (m & req == req) != (new.get(k, 0) & req == req):
                self.dirty[k] = None
        for k, m in new.items():
            if m & req == req and old.get(k, 0) & req != req:
                self.dirty[k] = None
        self.current = new
        self._recount()

    def _recount(self) -> None:
        req = self.required
        self.published_count = sum(1 for m in self.current.values() if m & req == req)

    def published_keys(self) -> list[int]:
        req = self.required
        return [k for k, m in self.current.items() if m & req == req]

    # ---- KVCM side ----------------------------------------------------------------------
    def take_batch(self, limit: int) -> list[tuple[int, bool]]:
        """Up to `limit` (key, publish?) pairs whose state differs from `acked`, in order."""
        out: list[tuple[int, bool]] = []
        dirty = self.dirty
        acked = self.acked
        while dirty and len(out) < limit:
            key = next(iter(dirty))
            del dirty[key]
            pub = self.is_published(key)
            if pub != (key in acked):  # never re-send an unchanged key
                out.append((key, pub))
        return out

    def confirm(self, sent: list[tuple[int, bool]], failed: Iterable[int] = ()) -> None:
        """KVCM applied `sent` except the items at `failed` indexes, which go back in front."""
        bad = set(failed)
        for i, (key, pub) in enumerate(sent):
            if i in bad:
                continue
            if pub:
                self.acked.add(key)
            else:
                self.acked.discard(key)
            if self.is_published(key) != pub:
                self.dirty[key] = None  # changed again while in flight
        if bad:
            self.requeue_front([sent[i][0] for i in sorted(bad)])

    def requeue_front(self, keys: list[int]) -> None:
        rest = self.dirty
        self.dirty = dict.fromkeys(keys)
        self.dirty.update(rest)

    def commit_snapshot(self, sent: set[int]) -> None:
        """KVCM now holds exactly `sent`; whatever changed since is dirty."""
        self.acked = sent
        req = self.required
        self.dirty = {
            k: None
            for k in (
                *(k for k, m in self.current.items() if (m & req == req) != (k in sent)),
                *(k for k in sent if self.current.get(k, 0) & req != req),
            )
        }

    def forget_acked(self) -> None:
        """KVCM dropped everything of this reporter (HOST_DOWN, tombstone)."""
        self.acked = set()
        self.dirty = dict.fromkeys(self.published_keys())

    def in_sync(self) -> bool:
        return not self.dirty and self.published_count == len(self.acked)
