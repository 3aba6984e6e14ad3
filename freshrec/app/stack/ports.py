"""Loopback ports for the stack's servers: free ones, and whether one accepts connections."""

from __future__ import annotations

import socket

from freshrec.app.stack.errors import StackError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


CLUSTER_BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10,000 (the cluster bus)."""


def free_cluster_port(taken: set[int] = frozenset()) -> int:
    """A free port for a cluster node whose bus port (+10,000) is free too, so at most
    55,535; not one of ``taken``."""
    import random

    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20_000, 65_536 - CLUSTER_BUS_OFFSET)
        if port not in taken and port_is_free(port) and port_is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise StackError("no free port pair (port and port + 10,000) found for a Redis Cluster node")


def accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
