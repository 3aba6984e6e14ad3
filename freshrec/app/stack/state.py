"""What an embedded stack is and where it is recorded: its broker (Apache Kafka or Tansu), its
processes (PID, port, binary, log), ``stack.json`` (read by ``down`` and ``status``) and
``stack.env`` (the connection settings, and the client profile that suits the broker, that
every other command reads)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "stack.json"


@dataclass(frozen=True)
class ServiceProcess:
    name: str
    pid: int
    port: int
    binary: str
    log: str


@dataclass(frozen=True)
class StackState:
    kafka: ServiceProcess
    """The broker, or an Apache Kafka cluster's first node."""
    redis: ServiceProcess
    started_at: float
    redis_nodes: tuple[ServiceProcess, ...] = ()
    """A cluster's other masters (``redis`` is its first); empty for a single server."""
    broker: str = "tansu"
    """``kafka`` (Apache Kafka) or ``tansu``; also the name of the client profile that suits
    it (``freshcore/kafka.py`` ``PROFILES``), which ``stack.env`` names."""
    kafka_nodes: tuple[ServiceProcess, ...] = ()
    """An Apache Kafka cluster's other nodes; empty for one broker."""

    @property
    def cluster(self) -> bool:
        return bool(self.redis_nodes)

    @property
    def brokers(self) -> tuple[ServiceProcess, ...]:
        return (self.kafka, *self.kafka_nodes)

    @property
    def processes(self) -> tuple[ServiceProcess, ...]:
        return (*self.brokers, self.redis, *self.redis_nodes)

    @property
    def env(self) -> dict[str, str]:
        redis_url = (
            f"redis+cluster://127.0.0.1:{self.redis.port}"
            if self.cluster
            else f"redis://127.0.0.1:{self.redis.port}/0"
        )
        return {
            "KAFKA_BOOTSTRAP_SERVERS": ",".join(f"127.0.0.1:{b.port}" for b in self.brokers),
            "REDIS_URL": redis_url,
            "FRESHREC_KAFKA_PROFILE": self.broker,
        }


def read_state(state_path: Path) -> StackState | None:
    """The state ``write_state`` recorded (None: no stack was recorded there)."""
    if not state_path.exists():
        return None
    data = json.loads(state_path.read_text())
    return StackState(
        kafka=ServiceProcess(**data["kafka"]),
        redis=ServiceProcess(**data["redis"]),
        started_at=data["started_at"],
        redis_nodes=tuple(ServiceProcess(**n) for n in data.get("redis_nodes", ())),
        broker=data.get("broker", "tansu"),
        kafka_nodes=tuple(ServiceProcess(**n) for n in data.get("kafka_nodes", ())),
    )


def write_state(state: StackState, state_path: Path, env_path: Path) -> None:
    """Record ``state`` (replacing the file at once) and its connection settings."""
    state_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "kafka": asdict(state.kafka),
        "redis": asdict(state.redis),
        "redis_nodes": [asdict(n) for n in state.redis_nodes],
        "started_at": state.started_at,
        "broker": state.broker,
        "kafka_nodes": [asdict(n) for n in state.kafka_nodes],
    }
    lines = ["# written by `freshrec stack up`; removed by `freshrec stack down`"]
    lines += [f"{k}={v}" for k, v in state.env.items()]
    _replace(env_path, "\n".join(lines) + "\n")
    _replace(state_path, json.dumps(payload, indent=2))


def _replace(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or its old content: never half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
