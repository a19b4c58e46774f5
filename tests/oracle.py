"""The reference meaning of a sequence of ring records, for property tests on both sides."""

from __future__ import annotations

from sidecar.shm_ring import layout as L


def fold(ops: list[tuple[int, int, int]]) -> dict[int, int]:
    """(kind, group, key) records in order -> key -> group mask of every key still held."""
    return {k: m for (k, _), m in fold_mediums([(kind, g, 0, k) for kind, g, k in ops]).items()}


def fold_mediums(ops: list[tuple[int, int, int, int]]) -> dict[tuple[int, int], int]:
    """(kind, group, medium, key) records in order -> (key, medium) -> group mask still held.

    A clear empties every medium and group."""
    state: dict[tuple[int, int], int] = {}
    for kind, group, medium, key in ops:
        if kind == L.KIND_CLEARED:
            state.clear()
        elif kind == L.KIND_STORED:
            state[key, medium] = state.get((key, medium), 0) | 1 << group
        else:
            v = state.get((key, medium), 0) & ~(1 << group)
            if v:
                state[key, medium] = v
            else:
                state.pop((key, medium), None)
    return state
