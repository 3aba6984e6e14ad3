"""The drills' pipeline: every FreshRec service as its own process on a private embedded
broker and a Redis of the drill's own, the drills' small world and its models, and synthetic
events from a thread.

``tools/drill_faults.py`` runs its faults on it, ``tools/drill_flood.py`` its flood of new
ids and ``tools/bench_modes.py`` the serving modes: each scenario, flood or mode gets a
``Pipeline`` of its own, seeded with models trained once (``train_models``).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from pathlib import Path

import redis as redis_lib
from confluent_kafka.admin import AdminClient

from freshcore.kafka import admin_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import catalogue_with, ensure_topics
from freshrec.app.stack import (
    EmbeddedStack,
    free_port,
    redis_binary,
)
from freshrec.app.training import train_on_world
from freshrec.promtext import scrape_port, total
from freshrec.sim.produce import ProduceStats, produce_events
from freshrec.sim.world import World, WorldConfig
from inference.training.train import TrainConfig
from tools.benchlib import service_process
from tools.drill_failover import FailoverCluster
from tools.seed import seed_world

WORLD = WorldConfig(seed=5, n_users=3000, n_items=400, n_categories=8)
DIM = 16
PARTITIONS = 4


class DurableRedis:
    """A Redis of the drill's own that survives SIGKILL with what it acknowledged."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis_lib.RedisError):
                if redis_lib.Redis.from_url(self.url, socket_timeout=1).ping():
                    return
            time.sleep(0.1)
        raise RuntimeError("the drill's Redis did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.kill()


class Pipeline:
    """The services of one scenario: a private broker, a durable Redis, streams, parameter
    server and workers as processes, models trained once."""

    def __init__(
        self, workdir: Path, models: Path, message_timeout_ms: int, cluster: bool = False
    ) -> None:
        self.workdir = workdir
        self.stack = EmbeddedStack(workdir / "stack")
        state = self.stack.up(detach=False)
        self.kafka_pid = state.kafka.pid
        self.models = models
        self.redis = (
            FailoverCluster(workdir / "redis") if cluster else DurableRedis(workdir / "redis")
        )
        self.redis.start()
        self.conn = ConnectionSettings.from_env({**state.env, "REDIS_URL": self.redis.url})
        ensure_topics(
            AdminClient(admin_config(self.conn)),
            "",
            catalogue_with({n: PARTITIONS for n in ("events", "recommend.requests", "gradients")}),
        )
        seed_world(self.redis.url, "", World(WORLD), models, PARTITIONS)
        self.env = {
            "FRESHREC_MODEL_DIR": str(models),
            "FRESHREC_EMBEDDING_DIM": str(DIM),
            "FRESHREC_HOT_DECAY_PER_HOUR": "1",  # whole counts: checked against the events
        }
        if message_timeout_ms:
            self.env["FRESHREC_MESSAGE_TIMEOUT_MS"] = str(message_timeout_ms)
        self.exits = contextlib.ExitStack()
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, command: str) -> None:
        port = free_port()
        self.ports[name] = port
        env = {**self.env, "FRESHREC_WORKER_ID": name}
        self.procs[name] = self.exits.enter_context(
            service_process(self.conn, command, port, env, self.workdir / f"{name}.log")
        )

    def wait_assigned(self, names: list[str], timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(
                total(scrape_port(self.ports[n]), "freshrec_assigned_partitions") > 0 for n in names
            ):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{names} did not join their groups")

    def metric(self, name: str, series: str, **labels) -> float:
        return total(scrape_port(self.ports[name]), series, **labels)

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self.procs.items()}

    def close(self) -> None:
        self.exits.close()
        self.redis.stop()
        self.stack.down()


def train_models(directory: Path) -> Path:
    train_on_world(
        World(WORLD),
        TrainConfig(impressions=40_000, dim=DIM, rankers=""),
        directory,
        lambda s: None,
    )
    return directory


class BackgroundEvents:
    """Synthetic events of the drills' world at ``rate`` per second, from a thread of its
    own, until ``stop``."""

    def __init__(self, conn: ConnectionSettings, rate: float) -> None:
        self.conn, self.rate = conn, rate
        self.stats: ProduceStats | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.stats = produce_events(
            self.conn,
            World(WORLD),
            rate_per_s=self.rate,
            duration_s=None,
            stop=self._stop,
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> ProduceStats | None:
        """Stop producing; what was produced (None if the thread has not finished within
        ``timeout_s``)."""
        self._stop.set()
        self._thread.join(timeout_s)
        return self.stats
