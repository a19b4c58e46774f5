# The C extension's signatures (_accel.c); buffers are contiguous numpy arrays.
from array import array
from typing import Any

ABI: int
KIND_STORED: int
KIND_REMOVED: int
W_TAIL: int
W_LAST_SEQ: int
W_ATTEMPTED: int
HEADER_WORDS: int

def find(
    ukeys: Any, tkeys: Any, tpos: Any, dense: Any, out: Any, n: int, insert: bool, /
) -> int: ...
def apply(pos: Any, metas: Any, masks: Any, /) -> None: ...
def put_runs(
    runs: list[Any],
    words: Any,
    hdr: Any,
    start: int,
    room: int,
    seq: int,
    attempted: int,
    tail: int,
    /,
) -> int: ...
def words(keys: list[Any], /) -> array[int]: ...
