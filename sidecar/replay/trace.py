"""Request traces for `kvcm-sidecar replay`: the Mooncake JSONL reader and the built-in generator.

Imports: stdlib, msgspec. A trace is validated whole before anything starts; a bad line is a
TraceError naming it. Mooncake `hash_ids` are per-trace block ids ("equal ids at the same
position mean a reusable prefix"); each full block becomes a chain key that commits to every id
before it, so equal keys mean equal prefixes, as the engine's rolling-hash keys do.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

_M = (1 << 64) - 1


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file and line."""


class _Line(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True)
class Request:
    rid: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    keys: tuple[int, ...]  # chain keys of the prompt's full blocks, in order


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit bijection that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M
    return x ^ (x >> 31)


def chain_keys(hash_ids: Iterable[int]) -> list[int]:
    """Signed 64-bit key per block, key_i = mix(key_{i-1} + mix(id_i)): key_i names the prefix."""
    out = []
    h = 0
    for i in hash_ids:
        h = _mix((h + _mix(i & _M) + 0x9E3779B97F4A7C15) & _M)
        out.append(h - (1 << 64) if h >> 63 else h)
    return out


def block_tokens(chain_key: int, n: int) -> list[int]:
    """The token ids of a block, from its chain key (the trace names blocks, not tokens): the
    ZMQ engines publish them and the router hashes them, so both agree, and equal prefixes
    have equal tokens. Token i = splitmix64(chain key + (i + 1) * golden) mod 150 000."""
    import numpy as np

    with np.errstate(over="ignore"):
        x = np.uint64(chain_key & _M) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(
            0x9E3779B97F4A7C15
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    out: list[int] = (x % np.uint64(150_000)).tolist()
    return out


def _request(rid: int, line: _Line, block_tokens: int) -> Request:
    full = min(line.input_length // block_tokens, len(line.hash_ids))  # a partial last block
    return Request(
        rid,
        line.timestamp / 1000.0,
        line.input_length,
        line.output_length,
        tuple(chain_keys(line.hash_ids[:full])),
    )


_decoder = msgspec.json.Decoder(_Line)


def parse(lines: Iterable[str | bytes], block_tokens: int, source: str = "trace") -> list[Request]:
    """Every request of a Mooncake-format trace; TraceError names the first bad line."""
    out: list[Request] = []
    last = -math.inf
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{source} line {n}"
        try:
            line = _decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{where}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: not a JSON object: {exc}") from None
        if line.timestamp < last:
            raise TraceError(
                f"{where}: timestamp {line.timestamp:g} is earlier than the line before ({last:g})"
            )
        if any(not 0 <= h < 1 << 64 for h in line.hash_ids):
            raise TraceError(f"{where}: hash_ids must be integers in [0, 2^64)")
        if line.input_length <= 0 or line.output_length < 0:
            raise TraceError(f"{where}: input_length must be > 0 and output_length >= 0")
        if len(line.hash_ids) * block_tokens < line.input_length:
            raise TraceError(
                f"{where}: {len(line.hash_ids)} hash_ids of {block_tokens} tokens cannot hold "
                f"input_length {line.input_length} (wrong --block-tokens?)"
            )
        last = line.timestamp
        out.append(_request(len(out), line, block_tokens))
    if not out:
        raise TraceError(f"{source}: no requests")
    return out


def read(path: Path, block_tokens: int) -> list[Request]:
    try:
        with path.open("rb") as f:
            return parse(f, block_tokens, str(path))
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Workload:
    """The built-in generator's shape: tenants with shared system prompts (Zipf popularity),
    conversations whose every turn extends the previous prompt, Poisson arrivals."""

    requests: int = 2000
    rate_per_s: float = 4.0
    tenants: int = 16
    zipf_s: float = 1.1
    system_blocks: tuple[int, int] = (8, 24)  # a tenant's system prompt, in blocks
    turn_blocks: tuple[int, int] = (2, 10)  # each turn's new user text + previous answer
    continue_p: float = 0.6  # an arrival is the next turn of a live conversation
    live_conversations: int = 64  # conversations a user may still come back to


# Small and conversation-heavy (the demo's and the replay test's): the live conversations
# outgrow one engine's cache of ~400 16-token blocks but not two, so keeping a conversation on
# one engine (what KVCM's view allows) is worth a wide margin over spreading it.
CONVERSATIONS = Workload(
    requests=300,
    rate_per_s=20.0,
    tenants=4,
    system_blocks=(2, 4),
    turn_blocks=(4, 8),
    continue_p=0.8,
    live_conversations=24,
)


def generate(w: Workload, seed: int, block_tokens: int) -> list[dict[str, object]]:
    """A trace in the Mooncake line format (so both sources take the same path)."""
    rng = random.Random(seed)
    next_id = 0

    def ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [ids(rng.randint(*w.system_blocks)) for _ in range(w.tenants)]
    weights = [1.0 / (i + 1) ** w.zipf_s for i in range(w.tenants)]
    live: list[list[int]] = []
    t_ms = 0.0
    out: list[dict[str, object]] = []
    for _ in range(w.requests):
        t_ms += rng.expovariate(w.rate_per_s) * 1000.0
        if live and rng.random() < w.continue_p:
            i = rng.randrange(len(live))
            prompt = live[i] + ids(rng.randint(*w.turn_blocks))
            live[i] = prompt
        else:
            tenant = rng.choices(range(w.tenants), weights)[0]
            prompt = systems[tenant] + ids(rng.randint(*w.turn_blocks))
            live.append(prompt)
            if len(live) > w.live_conversations:
                live.pop(rng.randrange(len(live)))
        out.append(
            {
                "timestamp": int(t_ms),
                "input_length": len(prompt) * block_tokens,
                "output_length": rng.randint(16, 512),
                "hash_ids": prompt,
            }
        )
    return out


def generated(w: Workload, seed: int, block_tokens: int) -> list[Request]:
    """The generator's trace, read back through the same checks as a file."""
    lines = [msgspec.json.encode(x) for x in generate(w, seed, block_tokens)]
    return parse(lines, block_tokens, f"generated trace (seed {seed})")


def theoretical_hit_rate(requests: Sequence[Request], block_tokens: int) -> float:
    """Reused tokens / input tokens with one infinite cache that holds every earlier prompt."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        n = 0
        for k in r.keys:
            if k not in seen:
                break
            n += 1
        hit += min(n * block_tokens, r.input_tokens - 1)
        total += r.input_tokens
        seen.update(r.keys)
    return hit / total if total else 0.0
