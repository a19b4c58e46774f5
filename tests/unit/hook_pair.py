"""What the differential tests of the C hook paths (test_c_flush, test_c_stage) share: the
Python forms of a hook (no compiled module), and the end of a run in which a C-form hook and a
Python-form hook got the same calls.

Imports: engine_hook, sidecar.shm_ring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from engine_hook.hook import Hook
from sidecar.shm_ring import compiled
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import unlink


@contextlib.contextmanager
def python_forms() -> Iterator[None]:
    """Hooks attached, and calls made, meanwhile use the numpy / Python forms."""
    built = compiled.accel
    compiled.accel = None
    try:
        yield
    finally:
        compiled.accel = built


def stop_flusher(h: Hook) -> None:
    """Stop the hook's flusher thread: from here on only the test's calls stage and publish."""
    assert h._thread is not None and h._bell is not None
    h._stopping = True
    h._bell.post()
    h._thread.join(5)
    assert not h._thread.is_alive()


def assert_same_end(c: Hook, py: Hook) -> None:
    """Both hooks counted the same and hold the same resident set."""
    sc, sp = c.stats(), py.stats()
    for key in ("staged", "last_seq", "dropped", "flushes", "problems"):
        assert sc[key] == sp[key]
    assert c._resident is not None and py._resident is not None
    with python_forms():
        py_resident = py._resident.as_dict()
    assert c._resident.as_dict() == py_resident


def close_pair(readers: Sequence[RingReader], hooks: Sequence[Hook], names: Sequence[str]) -> None:
    for r in readers:
        r.close()
    for h, name in zip(hooks, names, strict=True):
        h.close()
        unlink(name)
