"""Reference paged prefix cache: the engine the demo and end-to-end tests run.

Imports: stdlib, numpy, optional cupy, engine_hook. KV storage is a CuPy array when CuPy and a GPU
are present, a NumPy array otherwise. Every state change goes through the Hook, after the cache's
own arrays are updated (the snapshot provider contract). Block metadata lives in arrays so the
snapshot provider answers a million-key snapshot with a few vectorised copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine_hook.rolling_hash import block_keys


class HookLike(Protocol):
    def stored(self, keys: Any, group: int = 0) -> None: ...
    def removed(self, keys: Any, group: int = 0) -> None: ...
    def cleared(self) -> None: ...
    def set_snapshot_provider(self, provider: Any) -> None: ...


@dataclass(frozen=True)
class GroupSpec:
    name: str
    block_bytes: int = 4096
    window_blocks: int | None = None  # tail-sparse group: holds only a sequence's last N blocks


def _array_module(device: str) -> Any:
    if device == "cpu":
        return np
    try:
        import cupy  # optional GPU dependency, imported only when asked for

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:  # no CuPy, no driver or no device: the NumPy cache works the same
        if device == "gpu":
            raise
    return np


class _Group:
    def __init__(self, spec: GroupSpec, num_blocks: int, elems: int, xp: Any) -> None:
        self.spec = spec
        self.storage = xp.zeros((num_blocks, elems), dtype=xp.float16)
        self.key_of = np.zeros(num_blocks, np.int64)
        self.valid = np.zeros(num_blocks, np.bool_)
        self.index: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.free = list(range(num_blocks - 1, -1, -1))


class BlockCache:
    def __init__(
        self,
        num_blocks: int,
        block_size_tokens: int,
        groups: Sequence[GroupSpec],
        hook: HookLike,
        *,
        required_groups: Sequence[int] = (0,),
        device: str = "auto",
        elems_per_block: int = 8,
    ) -> None:
        if num_blocks <= 0 or not groups:
            raise ValueError("need at least one block and one group")
        self.xp = _array_module(device)
        self.block_size = block_size_tokens
        self.groups = [_Group(s, num_blocks, elems_per_block, self.xp) for s in groups]
        self.required = tuple(required_groups)
        self.hook = hook
        self.evictions = 0
        hook.set_snapshot_provider(self.snapshot)

    @property
    def device(self) -> str:
        return "gpu" if self.xp is not np else "cpu"

    def insert(self, token_ids: Sequence[int]) -> int:
        """Cache every full block of a sequence (prefill done); returns blocks newly stored."""
        return self.insert_keys(block_keys(token_ids, self.block_size))

    def insert_keys(self, keys: Sequence[int]) -> int:
        """`insert` for a sequence whose full blocks' prefix keys the caller already has."""
        new = 0
        for gi, g in enumerate(self.groups):
            w = g.spec.window_blocks
            wanted = keys if w is None else keys[-w:]
            for k in wanted:
                if k in g.index:
                    g.lru.move_to_end(k)  # an LRU touch is not a state change: nothing reported
                    continue
                b = self._allocate(gi, g)
                g.storage[b] = float(k & 0xFF)  # stands in for the KV produced by prefill
                g.key_of[b] = k
                g.valid[b] = True
                g.index[k] = b
                g.lru[k] = None
                self.hook.stored(k, gi)
                new += 1
        return new

    def _allocate(self, gi: int, g: _Group) -> int:
        if not g.free:
            old, _ = g.lru.popitem(last=False)
            b = g.index.pop(old)
            g.valid[b] = False
            self.evictions += 1
            self.hook.removed(old, gi)
            g.free.append(b)
        return g.free.pop()

    def evict(self, key: int, group: int | None = None) -> None:
        for gi, g in enumerate(self.groups):
            if (group is None or gi == group) and key in g.index:
                b = g.index.pop(key)
                del g.lru[key]
                g.valid[b] = False
                g.free.append(b)
                self.hook.removed(key, gi)

    def clear(self) -> None:
        for g in self.groups:
            g.valid[:] = False
            g.index.clear()
            g.lru.clear()
            g.free = list(range(len(g.valid) - 1, -1, -1))
        self.hook.cleared()

    def holds(self, key: int) -> int:
        """Group bitmask of `key`."""
        return sum(1 << gi for gi, g in enumerate(self.groups) if key in g.index)

    def published(self) -> set[int]:
        """Keys every required group holds: what KVCM should show for this replica."""
        sets = [set(self.groups[g].index) for g in self.required]
        return set.intersection(*sets) if sets else set()

    def match_blocks(self, token_ids: Sequence[int]) -> int:
        """Length in blocks of the longest published prefix of a prompt (the engine's own view)."""
        pub = self.published()
        n = 0
        for k in block_keys(token_ids, self.block_size):
            if k not in pub:
                break
            n += 1
        return n

    def prefix_blocks(self, keys: Sequence[int]) -> int:
        """How many leading `keys` every required group holds (`match_blocks` for known keys)."""
        indexes = [self.groups[g].index for g in self.required]
        n = 0
        for k in keys:
            if not all(k in ix for ix in indexes):
                break
            n += 1
        return n

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Snapshot provider: (keys, group masks), one entry per (key, group) held."""
        keys = []
        masks = []
        for gi, g in enumerate(self.groups):
            # A private copy of the mask first: the flusher thread calls this while the engine
            # thread inserts, and numpy's boolean index releases the GIL between counting the
            # mask's True entries and copying them, so a mask that gained one meanwhile wrote
            # past the result (heap corruption; AddressSanitizer on a stress of
            # sidecar/testbed/ring_engine.py's cache mode). A copy may be stale, never unsafe.
            k = g.key_of[g.valid.copy()]
            keys.append(k)
            masks.append(np.full(len(k), 1 << gi, np.uint32))
        return np.concatenate(keys), np.concatenate(masks)
