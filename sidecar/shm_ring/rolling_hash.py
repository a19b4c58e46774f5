"""KVCM's block key: RTP-LLM's rolling hash over token ids, one key per full block.

Imports: stdlib only. Start at h = 0; for each token t (int32), in signed 64-bit arithmetic,
h ^= t + 0x9e3779b97f4a7c15 + (h << 12) + (h >> 32) with an arithmetic right shift; after each
full block h is that block's key, so every key commits to the whole prefix before it. This is
the one reference: the engine hook (engine_hook.rolling_hash re-exports it), the router-facing
sidecar.keys and the KVCM-compatible server use it, the daemon its C loop (_accel.c `rolling`,
`roll_list`, through sidecar.keys); a test holds them equal. Here, in shm_ring, both sides may
import it (engine_hook imports only sidecar.shm_ring; routers never import engine_hook).
"""

from __future__ import annotations

from collections.abc import Iterable

_M = (1 << 64) - 1
_C = 0x9E3779B97F4A7C15


def to_signed(v: int) -> int:
    v &= _M
    return v - (1 << 64) if v >> 63 else v


def roll(
    token_ids: Iterable[int], block_size: int, h: int = 0, pending: int = 0
) -> tuple[int, int, list[int]]:
    """Continue the hash from state `h` (signed) with `pending` tokens since the last block
    boundary: (state after the tokens, tokens since the last boundary, keys of the blocks
    completed on the way)."""
    if block_size <= 0 or not 0 <= pending < block_size:
        raise ValueError("need block_size > 0 and 0 <= pending < block_size")
    keys: list[int] = []
    u = h & _M  # unsigned view of the signed hash
    n = pending
    for t in token_ids:
        signed = u - (1 << 64) if u >> 63 else u
        u ^= ((int(t) & _M) + _C + ((u << 12) & _M) + ((signed >> 32) & _M)) & _M
        n += 1
        if n == block_size:
            keys.append(u - (1 << 64) if u >> 63 else u)
            n = 0
    return (u - (1 << 64) if u >> 63 else u), n, keys


def block_keys(token_ids: Iterable[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids`; a trailing partial block has no key."""
    return roll(token_ids, block_size)[2]
