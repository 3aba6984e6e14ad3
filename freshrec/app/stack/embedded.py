"""The embedded stack: the broker (Apache Kafka, ``apachekafka.py``, or Tansu, ``tansu.py``;
``choice.py`` picks) and Redis, one server or a cluster (``redisserver.py``), as child
processes on free loopback ports. ``up`` records their PIDs in ``.freshrec/stack.json`` and
the connection settings in ``.freshrec/stack.env`` (``state.py``); ``down`` stops exactly
those PIDs, all at once; ``restart_broker`` stops Apache Kafka's nodes and starts them again
on their storage."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from freshcore.settings import BOOTSTRAP_SERVERS, REDIS_URL, STACK_ENV_FILE
from freshrec.app.settings import BROKER
from freshrec.app.stack.apachekafka import (
    KafkaCluster,
    KafkaNode,
    node_from_properties,
    node_id_of,
    node_name,
)
from freshrec.app.stack.choice import KAFKA, TANSU, BrokerChoice, choose_broker
from freshrec.app.stack.errors import StackError
from freshrec.app.stack.kafkajars import kafka_release
from freshrec.app.stack.kafkaprotocol import (
    wait_for_brokers,
    wait_for_partitions,
    warm_group_coordinator,
)
from freshrec.app.stack.ports import CLUSTER_BUS_OFFSET, free_cluster_port, free_port, port_is_free
from freshrec.app.stack.processes import pid_runs, stop_pids, wait_ready
from freshrec.app.stack.redisserver import (
    REDIS,
    describe,
    form_cluster,
    redis_binary,
    redis_ping,
    spawn_redis_node,
)
from freshrec.app.stack.state import STATE_FILE, ServiceProcess, StackState, read_state, write_state
from freshrec.app.stack.tansu import TansuBroker, broker_binary

READY_TIMEOUT_S = {KAFKA: 120.0, TANSU: 20.0}
"""How long ``up`` waits for each broker by default: a JVM start on a loaded machine."""
STOP_GRACE_S = {KAFKA: 30.0, TANSU: 2.0}
"""SIGTERM to SIGKILL: Apache Kafka shuts down cleanly within seconds; Tansu may ignore it."""
KAFKA_DIR = "kafka"
"""Under the state directory: each Apache Kafka node's properties and data."""


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
        timeout_s: float | None = None,
        detach: bool = True,
        redis_cluster: int = 0,
        broker: BrokerChoice | str | None = None,
        brokers: int = 1,
    ) -> StackState:
        """Start the broker and Redis (or return the running ones) and write ``stack.env``.
        ``broker``: a choice made already, or ``auto``, ``kafka`` or ``tansu`` (default
        ``FRESHREC_BROKER``; nothing is fetched here); ``brokers`` 3 starts a three-node
        Apache Kafka cluster; ``redis_cluster`` N a cluster of N masters instead of one Redis
        server (the first on ``redis_port``)."""
        if redis_cluster < 0 or redis_cluster == 1 or redis_cluster > 64:
            raise StackError(f"a Redis Cluster needs 2 to 64 masters, not {redis_cluster}")
        if brokers not in (1, 3):
            raise StackError(f"the stack runs 1 or 3 brokers, not {brokers}")
        if not isinstance(broker, BrokerChoice):
            broker = broker or BROKER.read(os.environ)
        current = self.running()
        if current:
            _check_same(current, _asked(broker), brokers, redis_cluster)
            return current
        if self.read_state():  # stale: a previous stack died without `down`
            self.down()
        if not isinstance(broker, BrokerChoice):
            broker = choose_broker(broker)
        if brokers > 1 and broker.kind != KAFKA:
            raise StackError(f"--brokers {brokers} needs Apache Kafka; {broker.line}")
        for label, port in (("broker", kafka_port), ("redis", redis_port)):
            if port is not None and not port_is_free(port):
                raise StackError(f"port {port} for the {label} is already in use")
        redis_bin = redis_binary()
        timeout_s = timeout_s or READY_TIMEOUT_S[broker.kind]
        for attempt in (1, 2):
            try:
                state = self._start(
                    self._broker(broker, kafka_port, brokers),
                    redis_bin,
                    _redis_ports(redis_port, redis_cluster),
                    cluster=bool(redis_cluster),
                    timeout_s=timeout_s,
                    detach=detach,
                )
                break
            except StackError as exc:
                # a port picked free and taken before the JVM bound it, seconds later: once
                # more with other ports (never a port that was asked for)
                if attempt == 2 or kafka_port is not None or "already in use" not in str(exc):
                    raise
        write_state(state, self.state_path, self.env_path)
        return state

    def _broker(
        self, broker: BrokerChoice, kafka_port: int | None, brokers: int
    ) -> KafkaCluster | TansuBroker:
        """The broker processes to start (not started yet), on free ports but ``kafka_port``
        (the first node's)."""
        logs = self.state_dir / "logs"
        if broker.kind == TANSU:
            return TansuBroker(broker_binary(), kafka_port or free_port(), logs)
        assert broker.java is not None and broker.release is not None
        ports: set[int] = set()
        nodes = []
        for node_id in range(1, brokers + 1):
            port = kafka_port if node_id == 1 and kafka_port else _free_port_but(ports)
            controller = _free_port_but(ports | {port})
            ports |= {port, controller}
            home = self.state_dir / KAFKA_DIR / f"node{node_id}"
            nodes.append(KafkaNode(node_id, port, controller, home, logs / node_name(node_id)))
        return KafkaCluster(broker.java.path, broker.release.lib, nodes)

    def _start(
        self,
        broker: KafkaCluster | TansuBroker,
        redis_bin: str,
        redis_ports: list[int],
        *,
        cluster: bool,
        timeout_s: float,
        detach: bool,
    ) -> StackState:
        """Start the broker and the Redis nodes and wait until every one answers (and a
        cluster has formed); on any failure stop all that was started and remove the
        broker's data."""
        logs = self.state_dir / "logs"
        redis_dir = self.state_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        started: list[subprocess.Popen] = []
        redis_procs: list[subprocess.Popen] = []
        nodes: list[ServiceProcess] = []
        kind = KAFKA if isinstance(broker, KafkaCluster) else TANSU
        try:
            broker.start(detach=detach, started=started)
            for n, port in enumerate(redis_ports):
                proc, node = spawn_redis_node(
                    redis_bin, n, port, redis_dir, logs, cluster=cluster, detach=detach
                )
                started.append(proc)
                redis_procs.append(proc)
                nodes.append(node)
            broker.wait(timeout_s)
            for proc, node in zip(redis_procs, nodes, strict=True):
                wait_ready(REDIS, proc, node.port, Path(node.log), timeout_s)
            wait_for_brokers(broker.bootstrap, len(broker.records), timeout_s)
            if kind == KAFKA:
                warm_group_coordinator(broker.bootstrap, timeout_s)
            for port in redis_ports:
                redis_ping(port, timeout_s)
            if cluster:
                form_cluster(redis_ports, timeout_s)
        except BaseException:
            stop_pids([p.pid for p in started], STOP_GRACE_S[kind])
            shutil.rmtree(self.state_dir / KAFKA_DIR, ignore_errors=True)
            raise
        return StackState(
            kafka=broker.records[0],
            redis=nodes[0],
            started_at=time.time(),
            redis_nodes=tuple(nodes[1:]),
            broker=kind,
            kafka_nodes=tuple(broker.records[1:]),
        )

    def restart_broker(self, *, timeout_s: float | None = None, detach: bool = True) -> StackState:
        """Stop the running stack's Apache Kafka nodes (SIGTERM to all at once, as ``down``)
        and start them again on their storage, ports and properties: topics, records and
        committed offsets are kept, as across a deployed broker's restart. Back once every
        node serves and every partition answers again; Redis runs on throughout.
        ``StackError`` when no stack runs, when its broker is Tansu (memory storage: a
        restart would keep nothing), or when a node does not serve again (it is stopped,
        and ``down`` clears the rest)."""
        state = self.running()
        if state is None:
            raise StackError("no embedded stack runs: `freshrec stack up` first")
        if state.broker != KAFKA:
            raise StackError("only Apache Kafka restarts on its storage; Tansu keeps nothing")
        logs = self.state_dir / "logs"
        nodes = []
        for proc in state.brokers:
            node_id = node_id_of(proc.name)
            home = self.state_dir / KAFKA_DIR / f"node{node_id}"
            text = (home / "server.properties").read_text()
            nodes.append(node_from_properties(text, home, logs / proc.name))
        stop_pids([p.pid for p in state.brokers], STOP_GRACE_S[KAFKA])
        cluster = KafkaCluster(state.kafka.binary, kafka_release().lib, nodes)
        timeout_s = timeout_s or READY_TIMEOUT_S[KAFKA]
        started: list[subprocess.Popen] = []
        try:
            cluster.start(detach=detach, started=started, fresh=False)
            cluster.wait(timeout_s)
            wait_for_brokers(cluster.bootstrap, len(nodes), timeout_s)
            wait_for_partitions(cluster.bootstrap, timeout_s)
        except BaseException:
            stop_pids([p.pid for p in started], STOP_GRACE_S[KAFKA])
            raise
        state = replace(state, kafka=cluster.records[0], kafka_nodes=tuple(cluster.records[1:]))
        write_state(state, self.state_path, self.env_path)
        return state

    def down(self) -> list[str]:
        """Stop exactly the processes ``up`` started, all at once (the nodes of an Apache
        Kafka cluster must go together); returns what was stopped."""
        state = self.read_state()
        stopped: list[str] = []
        if state:
            running = [p for p in state.processes if pid_runs(p)]
            stop_pids([p.pid for p in running], STOP_GRACE_S.get(state.broker, 2.0))
            stopped = [f"{p.name} (pid {p.pid}, port {p.port})" for p in running]
        shutil.rmtree(self.state_dir / KAFKA_DIR, ignore_errors=True)
        for path in (self.state_path, self.env_path):
            path.unlink(missing_ok=True)
        return stopped

    def status(self) -> str:
        state = self.read_state()
        if state is None:
            return "embedded stack: not running"
        nodes = len(state.brokers)
        rows = [
            "broker: Apache Kafka" + (f", {nodes} nodes" if nodes > 1 else "")
            if state.broker == KAFKA
            else "broker: Tansu"
        ]
        for proc in state.processes:
            alive = "running" if pid_runs(proc) else "DEAD"
            rows.append(
                f"{proc.name:6} {alive:8} pid {proc.pid:<8} 127.0.0.1:{proc.port:<6} {proc.binary}"
            )
        rows += [f"{k}={v}" for k, v in state.env.items()]
        return "\n".join(rows)


def _asked(broker: BrokerChoice | str) -> str | None:
    """The broker asked for by name (None: ``auto``, any)."""
    asked = broker.asked if isinstance(broker, BrokerChoice) else broker
    return None if asked == "auto" else asked


def _check_same(current: StackState, broker: str | None, brokers: int, redis_cluster: int) -> None:
    """A running stack is reused only with the brokers and the Redis asked for (the broker
    asked for by name, or whichever runs)."""
    if (broker and current.broker != broker) or len(current.brokers) != brokers:
        have = f"{len(current.brokers)} x {current.broker}"
        raise StackError(
            f"the embedded stack runs already with {have}, not {brokers} x {broker or 'any'}: "
            "`freshrec stack down` first"
        )
    if current.cluster != bool(redis_cluster) or (
        redis_cluster and len(current.redis_nodes) + 1 != redis_cluster
    ):
        have = len(current.redis_nodes) + 1 if current.cluster else 0
        raise StackError(
            f"the embedded stack runs already with {describe(have)}, not "
            f"{describe(redis_cluster)}: `freshrec stack down` first"
        )


def _free_port_but(taken: set[int]) -> int:
    while True:
        port = free_port()
        if port not in taken:
            return port


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
