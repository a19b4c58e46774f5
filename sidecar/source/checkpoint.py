"""The ZMQ source's checkpoint: store counts + the last applied seq + that batch's digest.

Imports: stdlib, numpy, msgspec. Written atomically (a temp file in the same directory, then
rename), so a reader sees the old file or the new one, never half of one. Mediums are stored by
name, so a changed medium map cannot make a count land in the wrong tier. A checkpoint proves
nothing by itself: the source replays from `last_seq` and compares the batch's digest first.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass

import msgspec
import numpy as np

VERSION = 1


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class _Table(msgspec.Struct, array_like=True):
    medium: str
    group: int
    keys: bytes  # int64 little-endian
    counts: bytes  # int64 little-endian


class _File(msgspec.Struct):
    version: int
    instance_id: str
    dp_rank: int
    endpoint: str
    last_seq: int
    digest: bytes
    tables: list[_Table]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_File)


class CheckpointError(Exception):
    """Unreadable, of another replica, or of another version: start without it."""


@dataclass
class Checkpoint:
    last_seq: int
    digest: bytes
    tables: list[tuple[str, int, np.ndarray, np.ndarray]]  # (medium, group, keys, counts)


def path_for(state_dir: str, instance_id: str, dp_rank: int, endpoint: str) -> str:
    ident = f"{instance_id}|{dp_rank}|{endpoint}"
    tag = hashlib.sha1(ident.encode(), usedforsecurity=False).hexdigest()[:16]
    return os.path.join(state_dir, f"kvcm-sidecar-zmq.{tag}.ckpt")


def save(path: str, instance_id: str, dp_rank: int, endpoint: str, ckpt: Checkpoint) -> int:
    """Write atomically; returns the bytes written."""
    tables = [
        _Table(
            m, g, np.ascontiguousarray(k, "<i8").tobytes(), np.ascontiguousarray(c, "<i8").tobytes()
        )
        for m, g, k, c in ckpt.tables
    ]
    body = _encoder.encode(
        _File(VERSION, instance_id, dp_rank, endpoint, ckpt.last_seq, ckpt.digest, tables)
    )
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(body)


def load(path: str, instance_id: str, dp_rank: int, endpoint: str) -> Checkpoint | None:
    """The checkpoint at `path`, None if there is none; CheckpointError if it is not usable."""
    try:
        with open(path, "rb") as f:
            body = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    try:
        data = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from None
    if data.version != VERSION:
        raise CheckpointError(f"{path} has version {data.version}, this sidecar reads {VERSION}")
    if (data.instance_id, data.dp_rank, data.endpoint) != (instance_id, dp_rank, endpoint):
        raise CheckpointError(f"{path} belongs to another replica or endpoint")
    tables = []
    for t in data.tables:
        if len(t.keys) != len(t.counts) or len(t.keys) % 8:
            raise CheckpointError(f"{path}: table {t.medium}/{t.group} is truncated")
        keys = np.frombuffer(t.keys, "<i8").astype(np.int64)
        counts = np.frombuffer(t.counts, "<i8").astype(np.int64)
        tables.append((t.medium, t.group, keys, counts))
    return Checkpoint(data.last_seq, data.digest, tables)
