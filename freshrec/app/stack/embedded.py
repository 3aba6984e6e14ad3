"""The embedded stack: the broker (``broker.py``) and Redis, one server or a cluster
(``redisserver.py``), as child processes on free loopback ports. ``up`` records their PIDs
in ``.freshrec/stack.json`` and the connection settings in ``.freshrec/stack.env``
(``state.py``); ``down`` stops exactly those PIDs."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from freshcore.settings import BOOTSTRAP_SERVERS, REDIS_URL, STACK_ENV_FILE
from freshrec.app.stack.broker import BROKER, broker_binary, kafka_metadata, spawn_broker
from freshrec.app.stack.errors import StackError
from freshrec.app.stack.ports import CLUSTER_BUS_OFFSET, free_cluster_port, free_port, port_is_free
from freshrec.app.stack.processes import pid_runs, stop_pid, wait_ready
from freshrec.app.stack.redisserver import (
    REDIS,
    describe,
    form_cluster,
    redis_binary,
    redis_ping,
    spawn_redis_node,
)
from freshrec.app.stack.state import STATE_FILE, ServiceProcess, StackState, read_state, write_state


class EmbeddedStack:
    """Start, inspect and stop the embedded broker and Redis; state under ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.state_path = state_dir / STATE_FILE
        self.env_path = state_dir / STACK_ENV_FILE

    def read_state(self) -> StackState | None:
        return read_state(self.state_path)

    def running(self) -> StackState | None:
        state = self.read_state()
        if state and all(pid_runs(p) for p in state.processes):
            return state
        return None

    def up(
        self,
        *,
        kafka_port: int | None = None,
        redis_port: int | None = None,
        timeout_s: float = 20.0,
        detach: bool = True,
        redis_cluster: int = 0,
    ) -> StackState:
        """Start both services (or return the running ones) and write ``stack.env``; with
        ``redis_cluster`` N a cluster of N masters instead of one Redis server (the first on
        ``redis_port``)."""
        if redis_cluster < 0 or redis_cluster == 1 or redis_cluster > 64:
            raise StackError(f"a Redis Cluster needs 2 to 64 masters, not {redis_cluster}")
        current = self.running()
        if current:
            _check_same_redis(current, redis_cluster)
            return current
        if self.read_state():  # stale: a previous stack died without `down`
            self.down()
        for label, port in (("broker", kafka_port), ("redis", redis_port)):
            if port is not None and not port_is_free(port):
                raise StackError(f"port {port} for the {label} is already in use")
        kafka_bin, redis_bin = broker_binary(), redis_binary()
        kafka_port = kafka_port or free_port()
        redis_ports = _redis_ports(redis_port, redis_cluster)
        state = self._start(
            kafka_bin,
            kafka_port,
            redis_bin,
            redis_ports,
            cluster=bool(redis_cluster),
            timeout_s=timeout_s,
            detach=detach,
        )
        write_state(state, self.state_path, self.env_path)
        return state

    def _start(
        self,
        kafka_bin: str,
        kafka_port: int,
        redis_bin: str,
        redis_ports: list[int],
        *,
        cluster: bool,
        timeout_s: float,
        detach: bool,
    ) -> StackState:
        """Start the broker and the Redis nodes and wait until every one answers (and a
        cluster has formed); on any failure stop all that was started."""
        logs = self.state_dir / "logs"
        redis_dir = self.state_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        started: list[subprocess.Popen] = []
        nodes: list[ServiceProcess] = []
        try:
            kafka_proc, kafka = spawn_broker(kafka_bin, kafka_port, logs, detach=detach)
            started.append(kafka_proc)
            for n, port in enumerate(redis_ports):
                proc, node = spawn_redis_node(
                    redis_bin, n, port, redis_dir, logs, cluster=cluster, detach=detach
                )
                started.append(proc)
                nodes.append(node)
            wait_ready(BROKER, kafka_proc, kafka_port, Path(kafka.log), timeout_s)
            for proc, node in zip(started[1:], nodes, strict=True):
                wait_ready(REDIS, proc, node.port, Path(node.log), timeout_s)
            kafka_metadata(kafka_port, timeout_s)
            for port in redis_ports:
                redis_ping(port, timeout_s)
            if cluster:
                form_cluster(redis_ports, timeout_s)
        except BaseException:
            for proc in started:
                stop_pid(proc.pid)
            raise
        return StackState(
            kafka=kafka, redis=nodes[0], started_at=time.time(), redis_nodes=tuple(nodes[1:])
        )

    def down(self) -> list[str]:
        """Stop exactly the processes ``up`` started; returns what was stopped."""
        state = self.read_state()
        stopped: list[str] = []
        if state:
            for proc in state.processes:
                if pid_runs(proc):
                    stop_pid(proc.pid)
                    stopped.append(f"{proc.name} (pid {proc.pid}, port {proc.port})")
        for path in (self.state_path, self.env_path):
            path.unlink(missing_ok=True)
        return stopped

    def status(self) -> str:
        state = self.read_state()
        if state is None:
            return "embedded stack: not running"
        rows = []
        for proc in state.processes:
            alive = "running" if pid_runs(proc) else "DEAD"
            rows.append(
                f"{proc.name:6} {alive:8} pid {proc.pid:<8} 127.0.0.1:{proc.port:<6} {proc.binary}"
            )
        rows += [f"{k}={v}" for k, v in state.env.items()]
        return "\n".join(rows)


def _check_same_redis(current: StackState, redis_cluster: int) -> None:
    """A running stack is reused only with the Redis asked for (a server, or N masters)."""
    if current.cluster != bool(redis_cluster) or (
        redis_cluster and len(current.redis_nodes) + 1 != redis_cluster
    ):
        have = len(current.redis_nodes) + 1 if current.cluster else 0
        raise StackError(
            f"the embedded stack runs already with {describe(have)}, not "
            f"{describe(redis_cluster)}: `freshrec stack down` first"
        )


def _redis_ports(redis_port: int | None, redis_cluster: int) -> list[int]:
    """The Redis node's port, or each cluster master's (the first ``redis_port`` if given)."""
    if redis_cluster and redis_port is not None and redis_port > 65_535 - CLUSTER_BUS_OFFSET:
        raise StackError(
            f"a Redis Cluster node's port must be at most 55535 (its bus listens 10,000 "
            f"higher), not {redis_port}"
        )
    redis_port = redis_port or (free_cluster_port() if redis_cluster else free_port())
    redis_ports = [redis_port]
    while len(redis_ports) < redis_cluster:
        redis_ports.append(free_cluster_port(set(redis_ports)))
    return redis_ports


def external_services(environ: Mapping[str, str] | None = None) -> bool:
    """True when the user points at existing services: then nothing is started.

    Both ``KAFKA_BOOTSTRAP_SERVERS`` and ``REDIS_URL`` must be set together.
    """
    environ = os.environ if environ is None else environ
    kafka, redis_url = BOOTSTRAP_SERVERS.read(environ, None), REDIS_URL.read(environ, None)
    if bool(kafka) != bool(redis_url):
        missing = "REDIS_URL" if kafka else "KAFKA_BOOTSTRAP_SERVERS"
        raise StackError(f"{missing} must be set too when pointing at existing services")
    return bool(kafka)
