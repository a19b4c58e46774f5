"""Ports for the test bed's children that must keep one port across restarts (the KVCM server,
a ZMQ engine, a sidecar's host_ip_port).

Imports: stdlib only. Port 0 is the kernel's pick from the ephemeral range, which is also where
every outgoing connection's local port comes from: a port picked there, released and bound again
later (a restarted engine) can meanwhile be some connection's local end ("Address already in
use"). So these come from below that range, at random, and must bind when picked; only
another process picking the same port in the instants between can still take one.
"""

from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_rng = random.SystemRandom()  # not the seeded nemesis's: ports must not repeat across runs


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds now and is not one the kernel hands out to connections."""
    hi = _ephemeral_low() - 1
    for _ in range(200):
        port = _rng.randint(min(10_000, hi - 1000), hi)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: the kernel's pick, as before
        s.bind((host, 0))
        got: int = s.getsockname()[1]
        return got
