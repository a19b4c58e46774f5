"""The hook's own record of resident (key, group) pairs, for engines that cannot enumerate theirs.

Imports: numpy + sidecar.shm_ring.layout. Invariant: `apply` sees every record in ring order, so
`export()` is exactly the fold of all records up to the last one applied (the snapshot fence).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from sidecar.shm_ring.layout import KIND_CLEARED, KIND_REMOVED, KIND_STORED


class ResidentSet:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def apply(self, keys: np.ndarray, metas: np.ndarray) -> None:
        self.apply_pairs(zip(keys.tolist(), metas.tolist(), strict=True))

    def apply_pairs(self, pairs: Iterable[tuple[int, int]]) -> None:
        d = self._masks
        get = d.get
        for k, m in pairs:
            if k >= 1 << 63:
                k -= 1 << 64  # same int64 bit pattern as the ring
            kind = m & 0xFF
            bit = 1 << ((m >> 8) & 0xFF)
            if kind == KIND_STORED:
                d[k] = get(k, 0) | bit
            elif kind == KIND_REMOVED:
                v = get(k, 0) & ~bit
                if v:
                    d[k] = v
                else:
                    d.pop(k, None)
            elif kind == KIND_CLEARED:
                d.clear()

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        d = self._masks
        n = len(d)
        return (
            np.fromiter(d.keys(), np.int64, n),
            np.fromiter(d.values(), np.uint32, n),
        )

    def as_dict(self) -> dict[int, int]:
        return dict(self._masks)
