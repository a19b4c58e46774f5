"""The chaos nemesis' schedule is a function of the seed, covers every fault kind, and bad
arguments exit 2 naming the option."""

from __future__ import annotations

import itertools

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
