"""The replay's per-policy figures, table and plot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sidecar.replay.report import Outcome, PolicyRun, document, percentile, plot, table


def run() -> PolicyRun:
    outs = []
    for i in range(10):
        o = Outcome(input_tokens=100, arrival_s=float(i), engine=i % 2, cached=50 if i < 4 else 0)
        o.end_s = o.arrival_s + (i + 1) / 10
        o.done_on = [o.engine]
        o.truth_blocks, o.predicted_blocks = 3, 3 if i else 2
        outs.append(o)
    return PolicyRun("kvcm", outs, ranks=2, consistent=True)


def test_report_summary_hit_rate_prefill_tokens_ttft_and_balance() -> None:
    s = run().summary()
    assert s["hit_rate"] == pytest.approx(200 / 1000)
    assert s["prefill_tokens"] == 800
    assert s["ttft_mean_s"] == pytest.approx(0.55)
    assert (s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"]) == pytest.approx((0.5, 0.9, 1.0))
    assert s["requests_per_engine"] == [5, 5]


def test_report_served_once_needs_one_done_from_the_chosen_engine() -> None:
    r = run()
    assert r.served_once()
    r.outcomes[3].done_on = [1, 1]
    assert not r.served_once()
    r.outcomes[3].done_on = [0]  # engine 1 was chosen
    assert not r.served_once()


def test_report_mismatch_share_counts_decisions_whose_view_differed() -> None:
    doc = document([run()], 0.5, {"requests": 10})
    assert doc["kvcm_view_mismatch_share"] == pytest.approx(0.1)
    assert doc["checks"]["kvcm"]["served_exactly_once"] is True
    assert "kvcm" in table(doc) and "50.0%" in table(doc)


def test_report_percentile_is_nearest_rank() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    assert percentile([], 0.5) == 0.0


def test_report_plot_writes_a_png_exactly_when_matplotlib_is_installed(tmp_path: Path) -> None:
    path = tmp_path / "r.png"
    drew = plot([run()], 0.5, path)
    assert drew == (importlib.util.find_spec("matplotlib") is not None)
    assert path.exists() == drew
    if drew:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
