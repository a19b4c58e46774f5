"""The chaos nemesis' schedule is a function of the seed, covers every fault kind, and bad
arguments exit 2 naming the option."""

from __future__ import annotations

import itertools
import random
import types
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import pytest

from sidecar.testbed import chaos


def test_chaos_schedule_is_the_same_for_the_same_seed() -> None:
    hosts = list(chaos.SOURCES)
    assert chaos.schedule(7, 30, hosts) == chaos.schedule(7, 30, hosts)
    assert chaos.schedule(7, 30, hosts) != chaos.schedule(8, 30, hosts)


def test_chaos_schedule_draws_every_fault_kind_and_overlaps_them() -> None:
    kinds: set[str] = set()
    overlapping = 0
    for seed in range(40):
        plan = chaos.schedule(seed, 30, list(chaos.SOURCES))
        kinds |= {f.kind for f in plan}
        overlapping += sum(1 for a, b in itertools.pairwise(plan) if b.at < a.at + a.hold)
        assert all(0 <= f.at < 30 and f.hold >= 0 for f in plan)
    assert kinds == set(chaos.FAULTS)
    assert overlapping > 100


def test_chaos_schedule_only_targets_hosts_that_exist() -> None:
    plan = chaos.schedule(3, 60, ["ring"])
    assert {f.target for f in plan} <= {"ring", "kvcm"}
    assert not {f.kind for f in plan} & {"zmq_cut", "zmq_restart", "checkpoint_unwritable"}


def test_chaos_bad_sources_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        chaos.parse(["--sources", "ring,tape"])
    assert exc.value.code == 2
    assert "--sources" in capsys.readouterr().err


def test_chaos_faults_none_is_an_empty_schedule() -> None:
    args = chaos.parse(["--faults", "none", "--duration", "30"])
    assert args.faults == []
    assert chaos.schedule(7, 30, list(chaos.SOURCES), args.faults) == []


def _samples(rss_kb: Sequence[float], every_s: float = 10.0) -> list[tuple[float, int, int, int]]:
    return [(i * every_s, int(r), 20, 500) for i, r in enumerate(rss_kb)]


def test_chaos_leak_figure_leaves_warm_up_out_of_the_slope() -> None:
    # 60 MB rising to 70 MB over the first third, then flat: warm-up, no growth after it
    rss = [60 * 1024 + min(i, 40) * 256 for i in range(121)]
    fig = chaos.leak_figure(_samples(rss))
    assert fig["rss_growth_mb_per_h"] == 0.0
    assert fig["rss_mb_after_warmup"] == [70.0, 70.0]
    assert fig["fds_after_warmup"] == [20, 20] and fig["held_keys_after_warmup"] == [500, 500]


def test_chaos_leak_figure_measures_a_steady_leak_in_mb_per_hour() -> None:
    # +1 MB every 360 s: 10 MB/h, the same over the last third (a leak keeps its slope)
    rss = [60 * 1024 + i * 1024 * 10 / 360 for i in range(361)]
    fig = chaos.leak_figure(_samples(rss))
    assert fig["rss_growth_mb_per_h"] == pytest.approx(10, abs=0.05)
    assert fig["rss_growth_last_third_mb_per_h"] == pytest.approx(10, abs=0.05)


def _flooded(leak_mb_per_h: float) -> list[tuple[float, int, int, int]]:
    # an engine that floods its sidecar now and then (500 -> 20 000 keys, 250 B each), denser
    # late in the run than early: the plain slope reads the floods as growth
    out = []
    for i in range(361):
        t = i * 10.0
        held = 20_000 if (i % 40 > 30 if i < 240 else i % 40 > 10) else 500
        rss_kb = 60 * 1024 + held * 250 / 1024 + leak_mb_per_h * 1024 * t / 3600
        out.append((t, int(rss_kb), 20, held))
    return out


@pytest.mark.parametrize("leak", [0.0, 6.0])
def test_chaos_leak_figure_net_of_held_keys_tells_floods_from_a_leak(leak: float) -> None:
    fig = chaos.leak_figure(_flooded(leak))
    assert abs(fig["rss_growth_mb_per_h"] - leak) > 2  # the floods skew the plain slope
    assert fig["rss_growth_net_of_held_mb_per_h"] == pytest.approx(leak, abs=0.05)
    assert fig["rss_floor_growth_mb_per_h"] == pytest.approx(leak, abs=0.2)


def test_chaos_key_history_from_differences_equals_the_samples_and_stays_bounded() -> None:
    rng = random.Random(25)
    ch = chaos.Changes(depth=60)
    samples: list[tuple[float, set[int], set[int]]] = []
    truth: set[int] = set()
    for i in range(400):
        if rng.random() < 0.7:  # a new truth set (a workload step), else the same object
            truth = (truth - {rng.randrange(40) for _ in range(3)}) | {rng.randrange(40)}
        seen = {k for k in truth if rng.random() < 0.9} | {rng.randrange(40)}
        ch.add(i * 0.5, truth, seen)
        samples.append((i * 0.5, truth, seen))
    assert len(ch.rows) == 60  # the checker's memory follows the depth, not the run's length
    for k in range(40):
        want = [(round(t, 2), k in tr, k in sn) for t, tr, sn in samples[-60:]]
        assert ch.rows_for(k) == want


class _CountingSet(set[tuple[int, str]]):
    unions = 0

    def __or__(self, other: AbstractSet[Any]) -> _CountingSet:  # type: ignore[override]
        _CountingSet.unions += 1
        return _CountingSet(set.__or__(self, other))


def test_chaos_checker_takes_a_mass_removal_in_a_bounded_number_of_set_operations(
    tmp_path: Path,
) -> None:
    # 20 000 of 25 000 held keys removed at once (a flood's half) once made the checker build
    # a union of every held set per removed key: minutes with the run's loop (and its fault
    # proxies) blocked, in the hour-long soak.
    run = chaos.Run(chaos.parse(["--sources", "plain", "--faults", "none"]), tmp_path)
    run.track("plain")
    host = types.SimpleNamespace()
    held = _CountingSet((k, "hbm") for k in range(25_000))
    kept = _CountingSet((k, "hbm") for k in range(20_000, 25_000))
    # the engine drops them, then KVCM does (the checker sees a removal it applied)
    for truth, seen in ((held, set(held)), (kept, set(held)), (kept, set(kept))):
        host.truth = truth
        run.check_sample("plain", host, seen, 1.0)  # type: ignore[arg-type]
    _CountingSet.unions = 0
    host.truth = kept
    run.check_sample("plain", host, set(kept), 1.5)  # type: ignore[arg-type]
    assert _CountingSet.unions <= 4
    assert run.gone["plain"] == {(k, "hbm") for k in range(20_000)}  # the removals KVCM showed
    assert run.violations == []


def test_chaos_a_slow_kvcm_restart_keeps_its_window_open_until_after_it_healed(
    tmp_path: Path,
) -> None:
    # The soak's seed 6300: a KVCM restart that took seconds (state save, exit, a new process
    # listening) on a loaded machine; the stale entries it restored first showed after a
    # window counted from the injection had closed, and were judged by the calm bound.
    run = chaos.Run(chaos.parse(["--sources", "plain", "--faults", "none"]), tmp_path)
    clock = [100.0]
    run.now = lambda: clock[0]  # type: ignore[method-assign]
    f = chaos.Fault(at=0.0, hold=0.4, kind="kvcm_restart", target="kvcm")
    window = run.begin(f)
    tail = chaos.Run.aftermath(f) - f.hold
    assert window[1] == pytest.approx(100.0 + f.hold + tail)
    clock[0] = 112.0  # the new server listens 12 s after the injection
    run.healed(window, f)
    assert window[1] == pytest.approx(112.0 + tail)
    since = 112.5  # a restored stale entry first shown then
    assert run.bound("plain", since, since + run.calm_bound_s + 1) > run.calm_bound_s
    clock[0] = 200.0
    assert run.bound("plain", 150.0, 160.0) == run.calm_bound_s  # long after: calm again
    # a quick injection never shortens the window it began with
    quick = run.begin(f)
    end = quick[1]
    run.healed(quick, f)
    assert quick[1] == end


@pytest.mark.parametrize("hidden", [True, False])
def test_chaos_a_stale_key_shown_as_its_reporter_reappears_counts_the_faults_while_hidden(
    tmp_path: Path, hidden: bool
) -> None:
    # The soak's seed 6300: KVCM restarted (with its state file), then 503s; the reporter
    # stayed hidden until its first event got through, and the entries KVCM restored showed,
    # one of them stale, after those faults' windows had closed. Shown with no hiding before,
    # the same key is judged by the calm bound, as before.
    run = chaos.Run(chaos.parse(["--sources", "plain", "--faults", "none"]), tmp_path)
    run.track("plain")
    clock = [10.0]
    run.now = lambda: clock[0]  # type: ignore[method-assign]
    held = {(k, "hbm") for k in range(10)}
    stale_key = (99, "hbm")
    host = types.SimpleNamespace(truth=held)
    run.check_sample("plain", host, set(held), 10.0)  # type: ignore[arg-type]
    f = chaos.Fault(at=0.0, hold=0.4, kind="kvcm_restart", target="kvcm")
    run.healed(run.begin(f), f)
    t = 11.0
    if hidden:
        while t < 30.0:  # hidden for 19 s, long after the restart's window
            run.check_sample("plain", host, set(), t)  # type: ignore[arg-type]
            t += 0.5
    else:
        t = 30.0
    while t < 30.0 + run.calm_bound_s + 2:
        run.check_sample("plain", host, held | {stale_key}, t)  # type: ignore[arg-type]
        t += 0.5
    stale = [v for v in run.violations if v.kind == "stale"]
    assert (stale == []) is hidden, stale
    assert run.stale_after_hiding == ({"plain": 1} if hidden else {})  # said in the summary
