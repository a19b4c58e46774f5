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
def fold_apply(
    pos: Any, metas: Any, masks: Any, required: int, out: Any, /
) -> tuple[int, int] | None: ...
def bits_apply(
    pos: Any, set_m: Any, clr_m: Any, masks: Any, queued: Any, required: int, out: Any, /
) -> tuple[int, int] | None: ...
def digits(buf: Any, at: int, width: int, col: int, keys: Any, /) -> None: ...
def delta_body(
    prefix: bytes,
    add_row: Any,
    add_col: int,
    del_row: Any,
    del_col: int,
    keys: Any,
    publish: Any,
    suffix: bytes,
    /,
) -> bytes: ...
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
def rolling(
    tokens: Any, block_size: int, h: int, pending: int, out: Any, /
) -> tuple[int, int, int]: ...
def roll_list(
    tokens: list[int], block_size: int, h: int, pending: int, /
) -> tuple[int, int, list[int]]: ...

W_CAPACITY: int
W_HEAD: int
W_HEAD_SEEN: int
W_READER_IDLE: int
AFTER_RING: int
AFTER_POST: int
AFTER_FOLD: int

class RunQueue:
    items: list[Any]
    n: int
    def __init__(self) -> None: ...

class Publisher:  # absent from a free-threaded build (its flush relies on the GIL)
    queue: RunQueue | None
    fast: int
    flushes: int
    busy: int
    fold_post_at: int
    fold_at: int
    run: tuple[Any, int] | None
    stage: int
    def __init__(
        self,
        staged: list[Any],
        token: list[Any],
        words: Any,
        hdr: Any,
        slow: Any,
        after: Any,
        /,
    ) -> None: ...
    def flush(self, wait: bool = False) -> int: ...
    def release(self) -> None: ...
    def staging(
        self,
        stored: Any,
        removed: Any,
        stored_meta: dict[Any, int],
        removed_meta: dict[Any, int],
        numpy: tuple[type, Any, Any] | None,
        /,
    ) -> None: ...
    def stored(self, keys: Any, group: int = 0, medium: str | None = None) -> None: ...
    def removed(self, keys: Any, group: int = 0, medium: str | None = None) -> None: ...
