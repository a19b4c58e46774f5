"""What one replay measured, per policy: hit rate, prefill tokens, TTFT percentiles, balance;
the table, the JSON document (`--json`) and the optional PNG.

Imports: stdlib; matplotlib only inside `plot` (the `plot` extra). Times are trace seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """One request's fate under one policy (filled from the engines' events)."""

    input_tokens: int
    arrival_s: float
    engine: int = -1
    cached: int = 0
    end_s: float = 0.0
    done_on: list[int] = field(default_factory=list)  # engines that reported it done
    truth_blocks: int | None = None  # the chosen engine's cached prefix at arrival
    predicted_blocks: int | None = None  # what the policy believed it was

    @property
    def ttft_s(self) -> float:
        return self.end_s - self.arrival_s


@dataclass
class PolicyRun:
    name: str
    outcomes: list[Outcome]
    ranks: int
    consistent: bool = False  # KVCM's view equalled every engine's cache at the end
    query_errors: int = 0
    dispatch_late_s: list[float] = field(default_factory=list)  # wall s behind the trace
    evictions: int = 0
    ring_dropped: int = 0  # records the engines' rings dropped (the sidecars then resync)

    def served_once(self) -> bool:
        return all(o.done_on == [o.engine] for o in self.outcomes)

    def ttfts(self) -> list[float]:
        return sorted(o.ttft_s for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        total = sum(o.input_tokens for o in self.outcomes)
        cached = sum(o.cached for o in self.outcomes)
        t = self.ttfts()
        per = [0] * self.ranks
        for o in self.outcomes:
            per[o.engine] += 1
        return {
            "hit_rate": cached / total if total else 0.0,
            "ttft_mean_s": sum(t) / len(t) if t else 0.0,
            "ttft_p50_s": percentile(t, 0.50),
            "ttft_p90_s": percentile(t, 0.90),
            "ttft_p99_s": percentile(t, 0.99),
            "prefill_tokens": total - cached,
            "requests_per_engine": per,
        }

    def mismatch_share(self) -> float | None:
        """Share of decisions where the policy's prefix for the chosen host != the engine's."""
        seen = [o for o in self.outcomes if o.predicted_blocks is not None]
        if not seen:
            return None
        return sum(o.predicted_blocks != o.truth_blocks for o in seen) / len(seen)

    def checks(self) -> dict[str, Any]:
        late = sorted(self.dispatch_late_s)
        return {
            "served_exactly_once": self.served_once(),
            "kvcm_view_matches_engines": self.consistent,
            "view_mismatch_share": self.mismatch_share(),
            "query_errors": self.query_errors,
            "evictions": self.evictions,
            "ring_dropped": self.ring_dropped,
            "dispatch_late_p99_wall_s": percentile(late, 0.99),
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def document(runs: Sequence[PolicyRun], theoretical: float, meta: dict[str, Any]) -> dict[str, Any]:
    kv = next((r for r in runs if r.name == "kvcm"), None)
    return {
        "policies": {r.name: r.summary() for r in runs},
        "theoretical_hit_rate": theoretical,
        "kvcm_view_mismatch_share": kv.mismatch_share() if kv else None,
        "checks": {r.name: r.checks() for r in runs},
        **meta,
    }


def table(doc: dict[str, Any]) -> str:
    rows = [
        f"  {'policy':<13}{'hit rate':>9}{'prefill Mtok':>13}{'TTFT mean':>10}{'p50':>9}"
        f"{'p90':>9}{'p99':>9}  requests per engine"
    ]
    for name, s in doc["policies"].items():
        rows.append(
            f"  {name:<13}{s['hit_rate']:>8.1%}{s['prefill_tokens'] / 1e6:>13.2f}"
            f"{s['ttft_mean_s']:>9.3f}s{s['ttft_p50_s']:>8.3f}s{s['ttft_p90_s']:>8.3f}s"
            f"{s['ttft_p99_s']:>8.3f}s  {' '.join(str(n) for n in s['requests_per_engine'])}"
        )
    rows.append(
        f"  theoretical max hit rate (one infinite cache): {doc['theoretical_hit_rate']:.1%}"
    )
    if doc.get("kvcm_view_mismatch_share") is not None:
        rows.append(
            "  kvcm: KVCM's prefix for the chosen host differed from the engine's in "
            f"{doc['kvcm_view_mismatch_share']:.2%} of decisions"
        )
    return "\n".join(rows)


def plot(runs: Sequence[PolicyRun], theoretical: float, path: Path) -> bool:
    """TTFT CDF per policy and hit-rate bars; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        t = r.ttfts()
        style = "--" if r.name == "oracle" else "-"  # kvcm and oracle may overlap
        cdf.plot(t, [(i + 1) / len(t) for i in range(len(t))], style, label=r.name)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s, trace time)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(alpha=0.3)
    cdf.legend()
    names = [r.name for r in runs]
    rates = [r.summary()["hit_rate"] for r in runs]
    bars.bar(names, rates, color="tab:blue")
    bars.axhline(theoretical, color="gray", linestyle="--", label="one infinite cache")
    for i, v in enumerate(rates):
        bars.text(i, v, f"{v:.1%}", ha="center", va="bottom")
    bars.set_ylabel("prefix-cache hit rate (reused / input tokens)")
    bars.set_title("hit rate")
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
