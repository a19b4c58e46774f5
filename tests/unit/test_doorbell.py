"""The doorbell: a producer posts `<ring>.bell` after publishing while the reader sleeps on it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import posix_ipc

from sidecar.shm_ring import layout as L
from sidecar.shm_ring.doorbell import Listener
from sidecar.shm_ring.segment import Segment, unlink
from sidecar.shm_ring.writer import RingWriter

META = L.pack_meta(L.KIND_STORED)
ROOT = Path(__file__).resolve().parents[2]


def _pending(ring_name: str) -> int:
    value: int = posix_ipc.Semaphore(L.doorbell_name(ring_name)).value
    return value


def test_doorbell_rings_only_while_the_reader_sleeps_and_at_most_once(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    # The semaphore alone (no listening thread), so pending posts stay countable.
    posix_ipc.Semaphore(L.doorbell_name(ring_name), posix_ipc.O_CREAT, initial_value=0)
    writer = RingWriter(Segment(ring_name))
    writer.write(np.arange(3, dtype=np.int64), META)
    writer.write_pairs([(9, META)])
    assert _pending(ring_name) == 0  # the reader is awake: no posts
    seg.hdr[L.W_READER_IDLE] = 1  # as the sidecar sets it before sleeping
    writer.write(np.arange(3, dtype=np.int64), META)
    writer.write_pairs([(9, META)])
    assert _pending(ring_name) == 1  # one wake-up pending, however many flushes
    writer.write(np.zeros(0, dtype=np.int64), META)  # nothing published: no ring
    assert _pending(ring_name) == 1


def test_doorbell_without_a_reader_bell_is_silent(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    seg.hdr[L.W_READER_IDLE] = 1  # an older sidecar never creates the semaphore
    writer = RingWriter(Segment(ring_name))
    assert writer.write(np.arange(3, dtype=np.int64), META) == 3  # and nothing raises
    assert writer.write_pairs([(9, META)]) == 1


def test_doorbell_listener_clears_a_stale_flag_and_close_clears_its_own(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    seg.hdr[L.W_READER_IDLE] = 1  # left by a reader killed while asleep
    bell = Listener(ring_name, seg.hdr, lambda: None)
    assert seg.hdr[L.W_READER_IDLE] == 0
    bell.asleep(True)
    bell.close()
    assert seg.hdr[L.W_READER_IDLE] == 0


def test_doorbell_wakes_the_listener_when_another_process_publishes(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    woke = threading.Event()
    bell = Listener(ring_name, seg.hdr, woke.set)
    bell.asleep(True)
    script = (
        "import sys, numpy as np\n"
        "from sidecar.shm_ring import layout as L\n"
        "from sidecar.shm_ring.segment import Segment\n"
        "from sidecar.shm_ring.writer import RingWriter\n"
        "RingWriter(Segment(sys.argv[1])).write(np.arange(5, dtype=np.int64),"
        " L.pack_meta(L.KIND_STORED))\n"
    )
    subprocess.run([sys.executable, "-c", script, ring_name], cwd=ROOT, check=True, timeout=60)
    assert woke.wait(30)  # rung by the engine process
    assert bell.rung == 1
    bell.close()


def test_unlink_removes_the_doorbell(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    Listener(ring_name, seg.hdr, lambda: None).close()
    seg.close()
    unlink(ring_name)
    assert not Path("/dev/shm/sem." + ring_name.lstrip("/") + ".bell").exists()
