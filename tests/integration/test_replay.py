"""`kvcm-sidecar replay` end to end: real engine, sidecar and server processes on a small
generated trace (written as a Mooncake-format file), and bad traces refused before any start.

The run takes ~10 s (2 engines + 2 sidecars + server, 300 requests, two policies), once per module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.replay.trace import CONVERSATIONS, generate
from sidecar.testbed.proc import ROOT

pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "replay", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    tmp = tmp_path_factory.mktemp("replay")
    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in generate(CONVERSATIONS, 1, 16)))
    out = cli(
        "--trace", str(trace), "--block-tokens", "16", "--ranks", "2", "--capacity-blocks",
        "400", "--speed", "5", "--policies", "round_robin,kvcm", "--json", str(tmp / "r.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc: dict[str, Any] = json.loads((tmp / "r.json").read_text())
    return doc, out.stdout


def test_replay_kvcm_hit_rate_beats_round_robin_by_a_wide_margin(
    result: tuple[dict[str, Any], str],
) -> None:
    p = result[0]["policies"]
    assert p["kvcm"]["hit_rate"] >= 1.25 * p["round_robin"]["hit_rate"], p
    assert p["kvcm"]["prefill_tokens"] < p["round_robin"]["prefill_tokens"]
    assert result[0]["theoretical_hit_rate"] >= p["kvcm"]["hit_rate"]


def test_replay_serves_every_request_exactly_once(result: tuple[dict[str, Any], str]) -> None:
    doc = result[0]
    for name in ("round_robin", "kvcm"):
        assert doc["checks"][name]["served_exactly_once"], name
        assert sum(doc["policies"][name]["requests_per_engine"]) == doc["requests"] == 300


def test_replay_ends_with_kvcm_showing_every_engines_cache(
    result: tuple[dict[str, Any], str],
) -> None:
    doc = result[0]
    for name in ("round_robin", "kvcm"):
        assert doc["checks"][name]["kvcm_view_matches_engines"], name
        assert doc["checks"][name]["evictions"] > 0, "the caches must have evicted"


def test_replay_json_has_the_documented_keys_and_the_table_is_printed(
    result: tuple[dict[str, Any], str],
) -> None:
    doc, stdout = result
    for s in doc["policies"].values():
        assert set(s) == {
            "hit_rate",
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "prefill_tokens",
            "requests_per_engine",
        }
        assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"]
    assert 0.0 <= doc["kvcm_view_mismatch_share"] < 1.0
    assert "theoretical max hit rate" in stdout and "round_robin" in stdout


def write(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(x + "\n" for x in lines))
    return p


GOOD = json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]})


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{broken", "line 2: not a JSON object"),
        (
            '{"timestamp": 5, "input_length": 512, "output_length": 1}',
            "line 2: Object missing required field `hash_ids`",
        ),
        (
            '{"timestamp": -5, "input_length": 512, "output_length": 1, "hash_ids": [1]}',
            "line 2: timestamp -5 is earlier than the line before (0)",
        ),
    ],
    ids=["malformed", "missing_field", "timestamp_backwards"],
)
def test_replay_bad_trace_line_exits_2_naming_it_before_starting(
    tmp_path: Path, line: str, says: str
) -> None:
    out = cli("--trace", str(write(tmp_path, GOOD, line, GOOD)))
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr and "bad.jsonl" in out.stderr
    assert out.stdout == ""  # nothing started


def test_replay_bad_option_exits_2_before_starting(tmp_path: Path) -> None:
    out = cli("--trace", str(write(tmp_path, GOOD)), "--policies", "kvcm,fastest")
    assert out.returncode == 2 and "--policies" in out.stderr and out.stdout == ""


def test_replay_source_zmq_rows_per_key_mode_and_engine_hash(tmp_path: Path) -> None:
    """`--source zmq`: vLLM-format engines hashing from tokens with a seed each; one row per
    (key mode, engine hash). Rolling keys route whatever the seed; engine keys a router cannot
    recompute (the key check says 0) route no better than load. (sha256_cbor_seed0's key check
    of 1: the zmq demo's test.)"""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in generate(CONVERSATIONS, 1, 16)))
    out = cli(
        "--source", "zmq", "--trace", str(trace), "--block-tokens", "16", "--ranks", "2",
        "--capacity-blocks", "400", "--speed", "5", "--requests", "120", "--policies",
        "round_robin,kvcm", "--key-mode", "rolling,engine", "--engine-hash", "random_seed",
        "--json", str(tmp_path / "z.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        (d["key_mode"], d["engine_hash"]): d
        for d in json.loads((tmp_path / "z.json").read_text())["rows"]
    }
    assert len(rows) == 2 and "key mode" in out.stdout
    for (mode, eh), d in rows.items():
        assert all(c["kvcm_view_matches_engines"] for c in d["checks"].values()), (mode, eh)
        assert all(c["served_exactly_once"] for c in d["checks"].values()), (mode, eh)
        assert d["key_check_vllm_sha256_cbor"] == [0, 0]  # a seed per engine: FlexLB cannot
    hit = {k: d["policies"]["kvcm"]["hit_rate"] for k, d in rows.items()}
    rr = rows[("rolling", "random_seed")]["policies"]["round_robin"]["hit_rate"]
    assert hit[("rolling", "random_seed")] >= 1.1 * rr  # rolling keys route whatever the seed
    assert hit[("engine", "random_seed")] < hit[("rolling", "random_seed")]
