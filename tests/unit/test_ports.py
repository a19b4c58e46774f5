"""The test bed's fixed ports come from below the ephemeral range, where no outgoing
connection's local port can take them between a child's restarts."""

from __future__ import annotations

import socket

import pytest

from sidecar.testbed import ports


def test_free_port_binds_and_is_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    got = {ports.free_port() for _ in range(20)}
    assert all(p < low for p in got)
    assert len(got) > 1  # random, not one port every run races for
    with socket.socket() as s:
        s.bind(("127.0.0.1", got.pop()))


def test_free_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        picks = iter([taken, taken, *range(20_000, 20_200)])
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: next(picks))
        assert ports.free_port() not in (taken, 0)
