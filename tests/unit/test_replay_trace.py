"""The replay's trace reader, chain keys and generator."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.replay.trace import (
    TraceError,
    Workload,
    chain_keys,
    generate,
    parse,
    theoretical_hit_rate,
)


def line(ts: int, ids: list[int], length: int | None = None) -> str:
    n = len(ids) * 4 if length is None else length
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": 3, "hash_ids": ids})


def test_trace_parse_reads_mooncake_fields_and_keys_full_blocks_only() -> None:
    reqs = parse([line(0, [1, 2, 3], 10), line(1500, [1, 2, 4])], block_tokens=4, source="t")
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert [r.rid for r in reqs] == [0, 1]
    assert reqs[0].input_tokens == 10
    assert len(reqs[0].keys) == 2  # 10 tokens: two full blocks, the third is partial
    assert reqs[1].keys[:2] == reqs[0].keys[:2]
    assert reqs[1].keys[2] not in reqs[0].keys


@given(st.lists(st.integers(0, 50), min_size=1, max_size=20), st.integers(0, 50))
def test_trace_chain_keys_equal_exactly_while_the_prefixes_are_equal(
    ids: list[int], other: int
) -> None:
    a = chain_keys(ids)
    i = len(ids) // 2
    changed = [*ids[:i], other, *ids[i + 1 :]]
    b = chain_keys(changed)
    assert a[:i] == b[:i]
    if other != ids[i]:
        assert all(x != y for x, y in zip(a[i:], b[i:], strict=True))
    assert all(-(1 << 63) <= k < (1 << 63) for k in a)


def test_trace_chain_keys_same_id_at_another_position_is_another_key() -> None:
    assert chain_keys([7, 7])[1] != chain_keys([7])[0]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("{not json", "line 2: not a JSON object"),
        (json.dumps({"timestamp": 5, "input_length": 4, "output_length": 1}), "line 2:"),
        (line(-1, [1]), "line 2: timestamp -1 is earlier than the line before (0)"),
        (line(5, [1], length=9), "line 2: 1 hash_ids of 4 tokens cannot hold input_length 9"),
        ('{"timestamp": "x", "input_length": 4, "output_length": 1, "hash_ids": [1]}', "line 2:"),
    ],
)
def test_trace_parse_bad_line_is_an_error_naming_it(bad: str, says: str) -> None:
    with pytest.raises(TraceError, match=r"^t ") as exc:
        parse([line(0, [1]), bad, line(9, [2])], block_tokens=4, source="t")
    assert says in str(exc.value)


def test_trace_parse_missing_field_names_the_field() -> None:
    bad = json.dumps({"timestamp": 5, "input_length": 4, "output_length": 1})
    with pytest.raises(TraceError, match=r"line 1: .*hash_ids"):
        parse([bad], block_tokens=4, source="t")


def test_trace_parse_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="no requests"):
        parse(["", "  "], block_tokens=4, source="t")


def test_trace_generate_is_a_valid_deterministic_trace_whose_turns_extend_prompts() -> None:
    w = Workload(requests=300)
    a = generate(w, seed=3, block_tokens=16)
    assert a == generate(w, seed=3, block_tokens=16)
    reqs = parse([json.dumps(x) for x in a], block_tokens=16)
    assert len(reqs) == 300
    assert all(r.input_tokens == 16 * len(r.keys) for r in reqs)
    seen: set[int] = set()
    reused = 0
    for r in reqs:
        reused += r.keys[0] in seen
        seen.update(r.keys)
    assert reused > 250  # a tenant's system prompt or the conversation's previous turn


def test_trace_theoretical_hit_rate_counts_the_longest_seen_prefix() -> None:
    reqs = parse([line(0, [1, 2]), line(1, [1, 2, 3, 4]), line(2, [9])], block_tokens=4)
    # 0 + 8 (two blocks of the second prompt) + 0, over 8 + 16 + 4 tokens
    assert theoretical_hit_rate(reqs, 4) == pytest.approx(8 / 28)


def test_replay_trace_hash_ids_beyond_64_bits_name_the_line() -> None:
    from sidecar.replay.trace import TraceError, parse

    head = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": '
    lines = [head + "[0]}", head + f"[{2**64}]}}"]
    with pytest.raises(TraceError, match=r"line 2.*hash_ids"):
        parse(lines, 512)
