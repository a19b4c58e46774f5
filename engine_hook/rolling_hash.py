"""KVCM's block key: RTP-LLM's rolling hash over token ids, one key per full block.

Imports: stdlib only. Start at h = 0; for each token t (int32), in signed 64-bit arithmetic,
h ^= t + 0x9e3779b97f4a7c15 + (h << 12) + (h >> 32) with an arithmetic right shift; after each
full block h is that block's key, so every key commits to the whole prefix before it.
"""

from __future__ import annotations

from collections.abc import Iterable

_M = (1 << 64) - 1
_C = 0x9E3779B97F4A7C15


def to_signed(v: int) -> int:
    v &= _M
    return v - (1 << 64) if v >> 63 else v


def block_keys(token_ids: Iterable[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids`; a trailing partial block has no key."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    keys: list[int] = []
    h = 0  # unsigned view of the signed hash
    n = 0
    for t in token_ids:
        signed = h - (1 << 64) if h >> 63 else h
        h ^= ((t & _M) + _C + ((h << 12) & _M) + ((signed >> 32) & _M)) & _M
        n += 1
        if n == block_size:
            keys.append(h - (1 << 64) if h >> 63 else h)
            n = 0
    return keys
