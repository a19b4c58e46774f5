"""The reference meaning of a sequence of ring records, for property tests on both sides."""

from __future__ import annotations

from sidecar.shm_ring import layout as L


def fold(ops: list[tuple[int, int, int]]) -> dict[int, int]:
    """(kind, group, key) records in order -> key -> group mask of every key still held."""
    state: dict[int, int] = {}
    for kind, group, key in ops:
        if kind == L.KIND_CLEARED:
            state.clear()
        elif kind == L.KIND_STORED:
            state[key] = state.get(key, 0) | 1 << group
        else:
            v = state.get(key, 0) & ~(1 << group)
            if v:
                state[key] = v
            else:
                state.pop(key, None)
    return state
