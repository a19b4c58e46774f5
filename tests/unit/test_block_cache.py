"""Rolling hash vectors and the reference block cache against a model."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hook.block_cache import BlockCache, GroupSpec
from engine_hook.rolling_hash import block_keys

# Computed by a 12-line C program implementing contract §7 with int64_t/uint64_t arithmetic
# (gcc 12, x86-64): signed keys after each 4-token block.
VECTORS = [
    ([1, 2, 3, 4, 5, 6, 7, 8], [455111481605203084, 6902853672176602142]),
    ([-1, 0, 2147483647, -2147483648, 42, 7, 7, 7], [455084956893545617, -5009744003326601778]),
    (
        [100000, 200000, 300000, 400000, 500000, 600000, 700000, 800000],
        [552793873315470115, 952071656780537519],
    ),
]


def test_rolling_hash_matches_c_vectors() -> None:
    for tokens, keys in VECTORS:
        assert block_keys(tokens, 4) == keys


def test_rolling_hash_partial_block_has_no_key_and_prefix_commits() -> None:
    assert block_keys([1, 2, 3], 4) == []
    assert block_keys([1, 2, 3, 4, 5, 6, 7], 4) == block_keys([1, 2, 3, 4], 4)
    assert block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != VECTORS[0][1][1]


class RecordingHook:
    def __init__(self) -> None:
        self.state: dict[int, int] = {}
        self.provider: Any = None

    def stored(self, keys: Any, group: int = 0) -> None:
        self.state[keys] = self.state.get(keys, 0) | (1 << group)

    def removed(self, keys: Any, group: int = 0) -> None:
        v = self.state.get(keys, 0) & ~(1 << group)
        if v:
            self.state[keys] = v
        else:
            self.state.pop(keys, None)

    def cleared(self) -> None:
        self.state.clear()

    def set_snapshot_provider(self, provider: Any) -> None:
        self.provider = provider


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), blocks=st.integers(2, 24))
def test_block_cache_transitions_match_model(seed: int, blocks: int) -> None:
    rng = random.Random(seed)
    hook = RecordingHook()
    cache = BlockCache(
        blocks,
        4,
        [GroupSpec("full"), GroupSpec("swa", window_blocks=2)],
        hook,
        required_groups=(0, 1),
        device="cpu",
    )
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    for _ in range(60):
        r = rng.random()
        if r < 0.8:
            p = rng.choice(prefixes)
            cache.insert(p + [rng.randrange(1000) for _ in range(rng.randrange(0, 12))])
        elif r < 0.97 and hook.state:
            cache.evict(rng.choice(sorted(hook.state)), rng.choice([None, 0, 1]))
        else:
            cache.clear()
        # The hook saw exactly the cache's (key, group) holdings ...
        assert hook.state == {k: cache.holds(k) for k in hook.state}
        held = {k for g in cache.groups for k in g.index}
        assert set(hook.state) == held
        # ... the snapshot provider agrees ...
        keys, masks = hook.provider()
        snap: dict[int, int] = {}
        for k, m in zip(keys.tolist(), masks.tolist(), strict=True):
            snap[k] = snap.get(k, 0) | m
        assert snap == hook.state
        # ... and "published" means every required group holds the key.
        assert cache.published() == {k for k, m in hook.state.items() if m & 3 == 3}
        assert all(len(g.index) <= blocks for g in cache.groups)


def test_block_cache_lru_touch_reports_nothing() -> None:
    hook = RecordingHook()
    cache = BlockCache(8, 4, [GroupSpec("full")], hook, device="cpu")
    assert cache.insert(list(range(8))) == 2
    before = dict(hook.state)
    assert cache.insert(list(range(8))) == 0
    assert hook.state == before
    assert cache.match_blocks(list(range(12))) == 2


def test_block_cache_uses_numpy_without_gpu() -> None:
    cache = BlockCache(4, 4, [GroupSpec("full")], RecordingHook(), device="auto")
    assert cache.device in ("cpu", "gpu")
    assert isinstance(cache.groups[0].storage, np.ndarray) == (cache.device == "cpu")
