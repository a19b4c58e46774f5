"""Byte layout of the engine->sidecar ring segment, shared by both sides.

Imports: stdlib + numpy only. Invariants: every offset here is 8-byte aligned and each cache
line has one writer; `docs/ring.md` is the prose twin of this file and a test keeps them equal.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

import numpy as np

MAGIC: Final = int.from_bytes(b"KVCMRING", "little")
LAYOUT_VERSION: Final = 1
# The sidecar reads the current and the previous layout (upgrade the sidecar first). Version 1 is
# the first, so its "previous" does not exist yet; the policy function below still pins the rule.
OLDEST_READABLE_VERSION: Final = 1
SLOT_SIZE: Final = 32
HEADER_SIZE: Final = 4096
DESCRIPTOR_OFFSET: Final = 1024
DESCRIPTOR_MAX: Final = HEADER_SIZE - DESCRIPTOR_OFFSET
DEFAULT_CAPACITY_SLOTS: Final = 1 << 16

# Header word indexes (u64 words; byte offset = 8 * index).
# Line 0: immutable after init.
W_MAGIC: Final = 0
W_VERSION_SLOT: Final = 1  # low 32 bits: layout version, high 32 bits: slot size
W_CAPACITY: Final = 2
W_HEADER_SIZE: Final = 3
W_CREATED_NS: Final = 4
# Line 1: producer cursor and counters (producer-written).
W_TAIL: Final = 8
W_DROPPED: Final = 9
W_LAST_SEQ: Final = 10
W_LIVENESS_NS: Final = 11
W_ATTEMPTED: Final = 12
W_PRODUCER_STATE: Final = 13
# The reader's cursor as the producer last read it: the producer's own cache (readers ignore
# it), in the header so the hook's C flush and its Python writer share one.
W_HEAD_SEEN: Final = 14
# Line 2: reader cursor and identity (reader-written).
W_HEAD: Final = 16
W_READER_PID: Final = 17
W_READER_INCARNATION: Final = 18
W_READER_LIVENESS_NS: Final = 19
W_SNAP_REQ: Final = 20
W_READER_IDLE: Final = 21  # 1 while the reader sleeps on the doorbell (shm_ring/doorbell.py)
# Line 3: producer incarnation, seqlock-protected by W_INC_GEN (odd while being written).
W_INC_GEN: Final = 24
W_BOOT_ID: Final = 25
W_PID: Final = 26
W_START_NS: Final = 27
W_INC_START_POS: Final = 28
W_PIDNS: Final = 29
W_DESCRIPTOR_LEN: Final = 30
# Line 4: snapshot response (producer-written, W_SNAP_RESP last).
W_SNAP_RESP: Final = 32
W_SNAP_SEQ: Final = 33
W_SNAP_COUNT: Final = 34
W_SNAP_DROPPED: Final = 35
W_SNAP_STATUS: Final = 36
W_SNAP_BOOT_ID: Final = 37
W_SNAP_BYTES: Final = 38

PRODUCER_NONE: Final = 0
PRODUCER_ATTACHED: Final = 1
PRODUCER_CLOSED: Final = 2

SNAP_OK: Final = 0
SNAP_FAILED: Final = 1

# Record kinds.
KIND_STORED: Final = 1
KIND_REMOVED: Final = 2
KIND_CLEARED: Final = 3
KIND_NAMES: Final = {KIND_STORED: "stored", KIND_REMOVED: "removed", KIND_CLEARED: "cleared"}

# Record = 4 u64 words: [seq, key, meta, parent]. seq is written last and checked by the reader.
C_SEQ: Final = 0
C_KEY: Final = 1
C_META: Final = 2
C_PARENT: Final = 3
RECORD_DTYPE: Final = np.dtype([("seq", "<u8"), ("key", "<i8"), ("meta", "<u8"), ("parent", "<i8")])
assert RECORD_DTYPE.itemsize == SLOT_SIZE

MAX_GROUPS: Final = 32  # groups are bits of a u32 mask in snapshots


def pack_meta(kind: int, group: int = 0, medium: int = 0, aux: int = 0) -> int:
    """meta = kind u8 | group u8 << 8 | medium u8 << 16 | aux u32 << 32."""
    return kind | (group << 8) | (medium << 16) | (aux << 32)


def meta_kind(meta: int) -> int:
    return meta & 0xFF


def meta_group(meta: int) -> int:
    return (meta >> 8) & 0xFF


def meta_medium(meta: int) -> int:
    """Index into the producer descriptor's medium table (0 = its default medium)."""
    return (meta >> 16) & 0xFF


def segment_bytes(capacity: int) -> int:
    return HEADER_SIZE + capacity * SLOT_SIZE


MIN_CAPACITY: Final = 8


def valid_capacity(capacity: int) -> bool:
    return capacity >= MIN_CAPACITY and capacity & (capacity - 1) == 0 and capacity <= 1 << 26


_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def segment_name(instance_id: str, dp_rank: int) -> str:
    """POSIX shm name for one (instance_id, dp_rank); the hash keeps sanitised ids distinct."""
    digest = hashlib.sha1(instance_id.encode(), usedforsecurity=False).hexdigest()[:10]
    safe = _UNSAFE.sub("_", instance_id)[:64]
    return f"/kvcm.{safe}.{digest}.dp{dp_rank}"


SHM_DIR: Final = "/dev/shm"  # noqa: S108 - Linux's POSIX shm mount, shared by design, mode 0600 files


def reader_lock_path(ring_name: str) -> str:
    return f"{SHM_DIR}/{ring_name.lstrip('/')}.reader.lock"


def snapshot_segment_name(ring_name: str) -> str:
    return f"{ring_name}.snap"


def doorbell_name(ring_name: str) -> str:
    """The POSIX semaphore an idle reader sleeps on (shm_ring/doorbell.py)."""
    return f"{ring_name}.bell"


def snapshot_bell_name(ring_name: str) -> str:
    """The POSIX semaphore the producer's flusher sleeps on; the reader posts it after a snapshot
    request (shm_ring/doorbell.py)."""
    return f"{ring_name}.snapbell"


class LayoutError(Exception):
    """The segment is not a ring this code can use; the message says which side to change."""


def check_readable(version: int, slot_size: int) -> None:
    """The written upgrade policy: upgrade the sidecar first; it reads layout N and N-1."""
    if version > LAYOUT_VERSION:
        raise LayoutError(
            f"ring layout v{version} is newer than this side understands "
            f"(max v{LAYOUT_VERSION}): upgrade the sidecar image first"
        )
    if version < max(OLDEST_READABLE_VERSION, LAYOUT_VERSION - 1):
        raise LayoutError(
            f"ring layout v{version} is older than supported "
            f"(min v{max(OLDEST_READABLE_VERSION, LAYOUT_VERSION - 1)}): upgrade the engine image"
        )
    if slot_size != SLOT_SIZE:
        raise LayoutError(f"ring slot size {slot_size} != {SLOT_SIZE}: layout mismatch")


# Snapshot segment: 64-byte header, then keys i64[cap], group masks u32[cap] and, when the
# header's SW_FLAGS has SNAP_FLAG_MEDIUMS, medium indexes u8[cap]. Producers from before mediums
# leave SW_FLAGS zero and write 12-byte entries; readers then take every entry as medium 0.
SNAP_MAGIC: Final = int.from_bytes(b"KVCMSNAP", "little")
SNAP_HEADER_SIZE: Final = 64
SW_MAGIC: Final = 0
SW_REQ: Final = 1
SW_COUNT: Final = 2
SW_CAPACITY: Final = 3  # entries the segment can hold
SW_FLAGS: Final = 4
SNAP_FLAG_MEDIUMS: Final = 1
SNAP_ENTRY_BYTES: Final = 13  # key 8 + mask 4 + medium 1
SNAP_ENTRY_BYTES_V0: Final = 12  # without the medium column


def snapshot_bytes(capacity_entries: int, flags: int = SNAP_FLAG_MEDIUMS) -> int:
    entry = SNAP_ENTRY_BYTES if flags & SNAP_FLAG_MEDIUMS else SNAP_ENTRY_BYTES_V0
    return SNAP_HEADER_SIZE + capacity_entries * entry
