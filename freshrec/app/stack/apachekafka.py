"""The stack's Apache Kafka: one to three KRaft nodes, each a broker and a controller in one
JVM on two loopback ports (clients, controller), for a single machine.

A node's storage is formatted afresh at each start of the stack (a new cluster id), so like
Tansu's memory storage a stack's topics live as long as the stack; a restart of the nodes
(``EmbeddedStack.restart_broker``) starts them on the storage they have. The settings are
those measured on a 2-core machine: a small heap with the serial collector and the C1
compiler only (about half the CPU of G1 and C2 to start, ~180 MiB resident), internal topics
of one partition, no initial rebalance delay, and the background threads few. Sessions from
1 s are accepted (``group.min.session.timeout.ms``); topics are never created by a producer,
as on the deployed broker. One node: replication factor 1. Three: factor 3,
``min.insync.replicas`` 2.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from freshrec.app.stack.errors import StackError
from freshrec.app.stack.kafkajars import LOG4J2
from freshrec.app.stack.ports import accepts
from freshrec.app.stack.processes import spawn
from freshrec.app.stack.state import ServiceProcess

BROKER_JVM = (
    "-Xms32m",
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Xss512k",
    "-XX:MaxMetaspaceSize=128m",
    "-Djava.awt.headless=true",
    # log4j2's own shutdown hook races Kafka's and loses the last lines of the shutdown
    "-Dlog4j2.shutdownHookEnabled=false",
)
TOOL_JVM = ("-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
"""The storage tool's JVM: it formats a folder and exits."""
FORMAT_TIMEOUT_S = 120.0
STARTED = "Kafka Server started"
"""The line a node logs once it serves: a port that accepts may be someone else's."""

SINGLE_MACHINE = {
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "1000",
    "group.consumer.min.session.timeout.ms": "1000",
    "group.consumer.min.heartbeat.interval.ms": "500",
    "group.consumer.heartbeat.interval.ms": "1000",
    "group.consumer.session.timeout.ms": "6000",
    "auto.create.topics.enable": "false",
    # one partition each: the first group join or init_transactions on a fresh broker does
    # not wait for 50 partitions to be created and loaded
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.num.partitions": "1",
    "share.coordinator.state.topic.num.partitions": "1",
    "num.partitions": "1",
    "log.retention.check.interval.ms": "1000",
    "log.cleaner.backoff.ms": "1000",
    "log.initial.task.delay.ms": "0",
    # not 0: at 0 a kafka-scheduler thread spins (~4.5% of a core at idle)
    "log.segment.delete.delay.ms": "1000",
    "file.delete.delay.ms": "1000",
    "num.network.threads": "2",
    "num.io.threads": "2",
    "num.recovery.threads.per.data.dir": "1",
    "log.cleaner.threads": "1",
    # on the heap: 128 MiB by default, more than -Xmx128m and ~110 MiB of resident memory
    "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
    "background.threads": "2",
}
"""Broker settings for one machine, beside the listeners and the replication."""


@dataclass(frozen=True)
class KafkaNode:
    """One node of the stack's cluster: its id (1, 2, 3), ports and folders."""

    node_id: int
    port: int
    controller_port: int
    home: Path
    """Its ``server.properties`` and its ``data`` (formatted at each start)."""
    logs: Path
    """Its ``server.log`` and ``console.log`` (the JVM's output), kept after a stop."""

    @property
    def name(self) -> str:
        return node_name(self.node_id)

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def properties(self) -> Path:
        return self.home / "server.properties"

    @property
    def console(self) -> Path:
        return self.logs / "console.log"

    @property
    def server_log(self) -> Path:
        return self.logs / "server.log"


def node_name(node_id: int) -> str:
    """How the stack names a node: ``kafka`` (the first), ``kafka2``, ``kafka3``."""
    return "kafka" if node_id == 1 else f"kafka{node_id}"


def node_id_of(name: str) -> int:
    """The node a stack's name for it names (``node_name``'s inverse).

    >>> node_id_of("kafka"), node_id_of("kafka3")
    (1, 3)
    """
    return int(name.removeprefix("kafka") or 1)


def node_properties(node: KafkaNode, voters: str, nodes: int) -> dict[str, str]:
    """A node's ``server.properties``: broker and controller on loopback, replication over
    up to three nodes (``min.insync.replicas`` up to 2).

    >>> props = node_properties(KafkaNode(2, 9092, 9093, Path("/k"), Path("/l")), "v", 3)
    >>> props["listeners"], props["default.replication.factor"], props["min.insync.replicas"]
    ('PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093', '3', '2')
    """
    replicas, isr = str(min(nodes, 3)), str(min(nodes, 2))
    return {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(node.data),
        "offsets.topic.replication.factor": replicas,
        "transaction.state.log.replication.factor": replicas,
        "share.coordinator.state.topic.replication.factor": replicas,
        "default.replication.factor": replicas,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.min.isr": isr,
        "min.insync.replicas": isr,
        **SINGLE_MACHINE,
    }


def node_from_properties(text: str, home: Path, logs: Path) -> KafkaNode:
    """The node a ``server.properties`` that ``node_properties`` wrote describes: its id and
    its two ports, for a start on the storage it has (``KafkaCluster.start(fresh=False)``).

    >>> text = "node.id=2\\nlisteners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093\\n"
    >>> node = node_from_properties(text, Path("/k"), Path("/l"))
    >>> node.node_id, node.port, node.controller_port
    (2, 9092, 9093)
    """
    props = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )
    ports = dict(re.findall(r"(\w+)://[^:,]+:(\d+)", props.get("listeners", "")))
    if "node.id" not in props or not {"PLAINTEXT", "CONTROLLER"} <= set(ports):
        raise StackError(f"{home / 'server.properties'} names no node id and listeners")
    return KafkaNode(
        int(props["node.id"]), int(ports["PLAINTEXT"]), int(ports["CONTROLLER"]), home, logs
    )


def voters_of(nodes: list[KafkaNode]) -> str:
    return ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in nodes)


def cluster_id() -> str:
    """A random KRaft cluster id (16 bytes, URL-safe base64), never starting with ``-``,
    which the storage tool would read as an option."""
    while True:
        found = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not found.startswith("-"):
            return found


def java_argv(java: str, lib: Path, node: KafkaNode, main: str, jvm: tuple[str, ...]) -> list[str]:
    return [
        java,
        *jvm,
        f"-Dlog4j2.configurationFile={LOG4J2}",
        f"-Dkafka.logs.dir={node.logs}",
        "-cp",
        f"{lib}/*",
        main,
    ]


def failure_reason(output: str) -> str:
    """A failed start's reason in one line: the first ``SomethingException: message`` of
    its output (Kafka logs its errors there), else its last line.

    >>> failure_reason("WARNING: x\\n[t] ERROR Exiting Kafka (kafka.Kafka$)\\n"
    ...     "org.apache.kafka.common.KafkaException: Socket server failed to bind to "
    ...     "127.0.0.1:9: Address already in use.\\n\\tat kafka.network.Acceptor")
    'KafkaException: Socket server failed to bind to 127.0.0.1:9: Address already in use.'
    """
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    for line in lines:
        m = re.match(r"^(?:Caused by: )?([\w.$]+(?:Exception|Error)): (.*)", line)
        if m:
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"
    return lines[-1] if lines else "no output"


def prepare_nodes(java: str, lib: Path, nodes: list[KafkaNode]) -> None:
    """Write each node's properties and format its storage afresh (one new cluster id; the
    nodes' storage tools run side by side)."""
    voters, cid = voters_of(nodes), cluster_id()
    formats = []
    for node in nodes:
        shutil.rmtree(node.data, ignore_errors=True)
        node.home.mkdir(parents=True, exist_ok=True)
        node.logs.mkdir(parents=True, exist_ok=True)
        props = node_properties(node, voters, len(nodes))
        node.properties.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        argv = java_argv(java, lib, node, "kafka.tools.StorageTool", TOOL_JVM)
        argv += ["format", "-t", cid, "-c", str(node.properties)]
        formats.append(
            subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    failures = []
    for node, proc in zip(nodes, formats, strict=True):
        try:
            out, _ = proc.communicate(timeout=FORMAT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failures.append(f"node {node.node_id}: no answer in {FORMAT_TIMEOUT_S:.0f}s")
            continue
        if proc.returncode != 0:
            failures.append(f"node {node.node_id}: {failure_reason(out.decode(errors='replace'))}")
    if failures:
        raise StackError(f"formatting Apache Kafka's storage failed: {failures[0]}")


class KafkaCluster:
    """The stack's Apache Kafka nodes: formatted and started together, and waited on until
    each serves."""

    def __init__(self, java: str, lib: Path, nodes: list[KafkaNode]) -> None:
        self.java, self.lib, self.nodes = java, lib, nodes
        self.records: list[ServiceProcess] = []
        self._procs: list[subprocess.Popen] = []
        self._offsets: list[tuple[int, int]] = []
        """Per node, where this start's lines begin in its server log and its console log
        (both are appended to)."""

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, *, detach: bool, started: list[subprocess.Popen], fresh: bool = True) -> None:
        """Format the nodes' storage (``fresh``; else start on the storage and properties
        they have), then start every node (appending each to ``started`` at once, so a
        failure stops what ran)."""
        if fresh:
            prepare_nodes(self.java, self.lib, self.nodes)
        for node in self.nodes:
            if not fresh and not (node.data / "meta.properties").is_file():
                raise StackError(f"Apache Kafka node {node.node_id} has no storage in {node.data}")
        for node in self.nodes:
            self._offsets.append((_size(node.server_log), _size(node.console)))
            argv = java_argv(self.java, self.lib, node, "kafka.Kafka", BROKER_JVM)
            proc = spawn([*argv, str(node.properties)], node.console, detach=detach)
            started.append(proc)
            self._procs.append(proc)
            self.records.append(
                ServiceProcess(node.name, proc.pid, node.port, self.java, str(node.server_log))
            )

    def wait(self, timeout_s: float) -> None:
        """Until every node serves (its port accepts and it logged so); a node that exits
        first raises ``StackError`` with its reason in one line."""
        deadline = time.monotonic() + timeout_s
        waiting = list(range(len(self.nodes)))
        while waiting:
            for i in list(waiting):
                node, proc, (log_at, console_at) = self.nodes[i], self._procs[i], self._offsets[i]
                if proc.poll() is not None:
                    reason = failure_reason(read_from(node.console, console_at))
                    raise StackError(
                        f"Apache Kafka node {node.node_id} exited with code {proc.returncode} "
                        f"at start: {reason} (log: {node.server_log})"
                    )
                if accepts(node.port) and STARTED in read_from(node.server_log, log_at):
                    waiting.remove(i)
            if waiting and time.monotonic() > deadline:
                ports = ", ".join(str(self.nodes[i].port) for i in waiting)
                raise StackError(
                    f"Apache Kafka did not serve on port {ports} within {timeout_s:.0f}s "
                    f"(log: {self.nodes[waiting[0]].server_log})"
                )
            time.sleep(0.05)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def read_from(path: Path, offset: int) -> str:
    """What a log file holds past ``offset`` (bytes; "" while it does not exist): the lines a
    node wrote since a start began."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
