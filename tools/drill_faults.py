"""Drill: faults under a steady load, and what each one costs.

Each scenario runs on a private embedded broker, a Redis of its own (append-only file,
fsync on every write, so that a killed Redis restarts with what it acknowledged), the streams
app, the parameter server and workers as their own processes, with synthetic events at
``--rate`` and closed-loop requests at ``--requests`` per second (each waits up to 30 s):

- ``broker_pause``: the broker frozen (SIGSTOP) for ``--pause`` seconds, then resumed. The
  producers' ``message.timeout.ms`` is shorter than the pause (``--message-timeout-ms``), so
  gradient deliveries fail during it and are produced again;
- ``redis_restart``: Redis SIGKILLed, restarted ``--outage`` seconds later on its port and
  files;
- ``redis_full``: Redis at ``maxmemory`` for ``--outage`` seconds (``maxmemory`` 1 byte,
  ``noeviction``: every write is refused with ``OOM``, reads are served), then lifted;
- ``rebalance``: a second worker joins under load, then the first leaves (SIGTERM);
- ``cluster_failover``: on a Redis Cluster (three masters, a replica of the first; node
  timeout 5 s) instead of one Redis, the first master SIGKILLed under load; its replica takes
  its slots over. Replication is asynchronous: what the master acknowledged last may be gone.

Per scenario: events produced / counted by the streams app / learnt by the workers (at least
once: the excess is what was learnt twice; in ``rebalance`` the leaver's count is read just
before it leaves, so what it learns while leaving is missing), and whether the workers' group
committed every ``events`` partition to its end (a worker commits an event only once its
gradients are delivered: every event learnt); requests sent / answered / timed out / answered
twice; gradient rows applied beyond those sent (a message applied twice); the seconds from
the fault's end to the first reply; whether every service is alive at the end; the Redis calls
the services waited out, by reason (``freshrec_redis_unavailable_total``).

What Redis holds at the end, checked against the topics (hot scores do not decay in the drill,
``FRESHREC_HOT_DECAY_PER_HOUR=1``, so stored counts are whole numbers): the impressions,
clicks and conversions in the streams app's state rows sum to the events counted (none lost,
none twice); and the parameter server's tables equal those of a second parameter server run
from scratch over a copy of the ``gradients`` topic (same rows, same versions: every message
applied exactly once). Partitions whose state was written again because Redis had lost an
acknowledged write are counted (``freshrec_streams_state_rewrites_total``,
``freshrec_ps_partition_rewrites_total``).

    .venv/bin/python -m tools.drill_faults [--scenarios broker_pause,redis_restart,rebalance]
        [--rate 500] [--requests 10] [--pause 20] [--outage 10]  (also: redis_full)

Writes artifacts/drill_faults.json (``--out``). Needs nothing running. The tests run the same
scenarios, shorter (``tests/test_faults_e2e.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis as redis_lib
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from freshcore.kafka import admin_config, consumer_config, producer_config
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames, catalogue_with, ensure_topics
from freshrec.app.stack import (
    EmbeddedStack,
    free_port,
    redis_binary,
)
from freshrec.app.training import train_on_world
from freshrec.client import RecommendClient, RecommendTimeout
from freshrec.promtext import scrape_port, total
from freshrec.sim.produce import produce_events
from freshrec.sim.world import World, WorldConfig
from inference.training.train import TrainConfig
from param_server.store import applied_offsets
from schemas.rowbatch import TABLE_NAMES
from schemas.rows import decode_row
from streams.item_state import ItemPartitionState
from streams.settings import StreamsSettings
from tools.benchlib import save, service_process, wait_until
from tools.drill_failover import FailoverCluster
from tools.drill_worker import committed, partition_ends
from tools.seed import seed_world

WORLD = WorldConfig(seed=5, n_users=3000, n_items=400, n_categories=8)
DIM = 16
PARTITIONS = 4
REFERENCE = "ref."
"""The topic prefix (and Redis key prefix) of the reference parameter server."""
SCENARIOS = ("broker_pause", "redis_restart", "redis_full", "rebalance", "cluster_failover")


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


@dataclass
class RequestStats:
    sent: int = 0
    answered: int = 0
    timed_out: int = 0
    errors: int = 0
    answered_twice: int = 0
    last_reply: float = 0.0
    replies_at: list[float] = field(default_factory=list)


class RequestLoop:
    """Recommendation requests at a steady rate from a thread of its own; each waits up to
    ``timeout_s``. A reply for the same request twice counts as answered twice."""

    def __init__(self, conn: ConnectionSettings, rate: float, timeout_s: float = 30.0) -> None:
        self.conn, self.rate, self.timeout_s = conn, rate, timeout_s
        self.stats = RequestStats()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with RecommendClient(
            self.conn.kafka_bootstrap_servers,
            topic_prefix=self.conn.topic_prefix,
            timeout_s=self.timeout_s,
            profile=self.conn.kafka_profile,
        ) as client:
            tasks = set()
            j = 0
            start = time.monotonic()
            while not self.stop.is_set():
                j += 1
                tasks.add(asyncio.ensure_future(self._one(client, f"u{j % WORLD.n_users}")))
                await asyncio.sleep(max(0.0, start + j / self.rate - time.monotonic()))
            await asyncio.gather(*tasks, return_exceptions=True)
            self.stats.answered_twice = client.stats.duplicate

    async def _one(self, client, user: str) -> None:
        self.stats.sent += 1
        try:
            await client.recommend(user, 5)
            self.stats.answered += 1
            self.stats.replies_at.append(time.monotonic())
        except RecommendTimeout:
            self.stats.timed_out += 1
        except Exception:
            self.stats.errors += 1


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
        self.conn = ConnectionSettings(state.env["KAFKA_BOOTSTRAP_SERVERS"], self.redis.url)
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


def redis_check(pipe: Pipeline, workers: list[str]) -> dict:
    """What Redis holds, against what the topics say it should (the module's docstring)."""
    keys = RedisKeys("")
    r = connect(pipe.conn.redis_url)
    names = TopicNames("")
    admin = AdminClient(admin_config(pipe.conn))
    n_by_item = len(
        admin.list_topics(names.events_by_item, 10).topics[names.events_by_item].partitions
    )
    stored = 0.0
    config = StreamsSettings.from_env(pipe.env).state
    for q in range(n_by_item):
        meta = {k.decode(): v.decode() for k, v in r.hgetall(keys.streams_meta(q)).items()}
        rows = {k.decode(): v for k, v in r.hgetall(keys.streams_rows(q)).items()}
        state = ItemPartitionState.restore(config, meta, rows)
        stored += float(state.counts[: state.n_items, 0, :].sum())
    counted = pipe.metric("streams", "freshrec_streams_counted_events_total")
    got = stored_tables(r, keys)
    want = reference_tables(pipe)
    same_rows = set(got) == set(want)
    versions_differ = sum(1 for k in want if k in got and got[k][1] != want[k][1])
    rows_differ = sum(
        1 for k in want if k in got and not np.allclose(got[k][0], want[k][0], atol=1e-6)
    )
    return {
        "streams_counts_in_redis": round(stored, 3),
        "streams_counted": int(counted),
        "streams_rewrites": pipe.metric("streams", "freshrec_streams_state_rewrites_total"),
        "ps_rows": len(got),
        "ps_rows_as_reference": same_rows and versions_differ == 0 and rows_differ == 0,
        "ps_rows_missing_or_extra": len(set(got) ^ set(want)),
        "ps_versions_differ": versions_differ,
        "ps_values_differ": rows_differ,
        "ps_rewrites": pipe.metric("param-server", "freshrec_ps_partition_rewrites_total"),
    }


def stored_tables(r, keys: RedisKeys) -> dict[tuple[str, bytes], tuple[np.ndarray, int]]:
    """Every embedding row the parameter server wrote: (table, field) -> (row, version)."""
    out = {}
    for name in TABLE_NAMES.values():
        for shard in range(PARTITIONS):
            for k, v in r.hgetall(keys.embeddings(name, shard)).items():
                row, version, _ = decode_row(v, DIM + 1)
                out[(name, k)] = (row, version)
    return out


def reference_tables(pipe: Pipeline) -> dict:
    """The tables of a parameter server run from scratch over a copy of ``gradients``, seeded
    as the drill's were, under another topic prefix on the same Redis."""
    names, ref = TopicNames(""), TopicNames(REFERENCE)
    conn = ConnectionSettings(pipe.conn.kafka_bootstrap_servers, pipe.conn.redis_url, REFERENCE)
    ensure_topics(
        AdminClient(admin_config(conn)), REFERENCE, catalogue_with({"gradients": PARTITIONS})
    )
    seed_world(conn.redis_url, REFERENCE, World(WORLD), pipe.models, PARTITIONS)
    source = Consumer(consumer_config(pipe.conn, None))
    ends = partition_ends(pipe.conn, names.gradients)
    source.assign([TopicPartition(names.gradients, q, OFFSET_BEGINNING) for q in ends])
    sink = Producer(producer_config(conn))
    copied = {q: 0 for q in ends}
    deadline = time.monotonic() + 120
    while any(copied[q] < ends[q] for q in ends) and time.monotonic() < deadline:
        for msg in source.consume(10_000, 0.5):
            if msg.error() is None:
                sink.produce(ref.gradients, msg.value(), msg.key(), partition=msg.partition())
                copied[msg.partition()] = msg.offset() + 1
                sink.poll(0)
    source.close()
    sink.flush(60)
    keys = RedisKeys(REFERENCE)
    r = connect(conn.redis_url)
    port = free_port()
    with service_process(conn, "param-server", port, pipe.env, pipe.workdir / "ps-ref.log"):
        wait_until(
            lambda: (
                applied_offsets(r, keys, list(ends)) == {q: e - 1 for q, e in ends.items() if e}
            ),
            120,
            "the reference parameter server",
        )
    return stored_tables(r, keys)


def train_models(directory: Path) -> Path:
    train_on_world(
        World(WORLD),
        TrainConfig(impressions=40_000, dim=DIM, rankers=""),
        directory,
        lambda s: None,
    )
    return directory


def run_scenario(
    scenario: str,
    models: Path,
    *,
    rate: float = 500.0,
    requests: float = 10.0,
    pause_s: float = 20.0,
    outage_s: float = 10.0,
    settle_s: float = 10.0,
    message_timeout_ms: int | None = None,
    workdir: Path | None = None,
) -> dict:
    """One scenario start to end; the figures of its report (see the module's docstring)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"freshrec-{scenario}-"))
    pipe = Pipeline(workdir, models, message_timeout_ms, cluster=scenario == "cluster_failover")
    failover_s = None
    workers = ["worker-a"]
    try:
        pipe.start("streams", "streams")
        pipe.start("param-server", "param-server")
        pipe.start("worker-a", "worker")
        pipe.wait_assigned(["streams", "param-server", "worker-a"])
        load = RequestLoop(pipe.conn, requests)
        stop_events = threading.Event()
        produced = {}

        def events() -> None:
            produced["stats"] = produce_events(
                pipe.conn,
                World(WORLD),
                rate_per_s=rate,
                duration_s=None,
                stop=stop_events,
            )

        producer = threading.Thread(target=events, daemon=True)
        producer.start()
        load.thread.start()
        time.sleep(settle_s)  # a steady load before the fault
        learnt_by_leaver = 0.0
        if scenario == "broker_pause":
            os.kill(pipe.kafka_pid, signal.SIGSTOP)
            time.sleep(pause_s)
            os.kill(pipe.kafka_pid, signal.SIGCONT)
        elif scenario == "redis_restart":
            pipe.redis.kill()
            time.sleep(outage_s)
            pipe.redis.start()
        elif scenario == "redis_full":
            store = redis_lib.Redis.from_url(pipe.redis.url)
            store.config_set("maxmemory-policy", "noeviction")
            store.config_set("maxmemory", 1)
            time.sleep(outage_s)
            store.config_set("maxmemory", 0)
            store.close()
        elif scenario == "cluster_failover":
            failover_s = round(pipe.redis.kill_first_master(), 2)
            time.sleep(outage_s)
        elif scenario == "rebalance":
            pipe.start("worker-b", "worker")
            workers.append("worker-b")
            pipe.wait_assigned(["worker-b"])
            time.sleep(settle_s)
            learnt_by_leaver = pipe.metric(
                "worker-a", "freshrec_worker_events_total", outcome="valid"
            )
            pipe.procs["worker-a"].send_signal(signal.SIGTERM)  # it leaves the group
            pipe.procs["worker-a"].wait(60)
            workers.remove("worker-a")
        else:
            raise ValueError(f"no such scenario: {scenario}")
        fault_over = time.monotonic()
        time.sleep(settle_s)  # the load goes on after it
        stop_events.set()
        producer.join(60)
        load.stop.set()
        load.thread.join(60)
        sent_events = produced["stats"].delivered

        def settled() -> tuple[float, float]:
            counted = pipe.metric("streams", "freshrec_streams_counted_events_total")
            learnt = learnt_by_leaver + sum(
                pipe.metric(w, "freshrec_worker_events_total", outcome="valid") for w in workers
            )
            return counted, learnt

        names = TopicNames("")
        ends = partition_ends(pipe.conn, names.events)

        def all_committed() -> bool:
            got = committed(pipe.conn, "freshrec-workers", names.events, ends)
            return all(got.get(q, -1) >= end for q, end in ends.items())

        deadline = time.monotonic() + 120
        counted, learnt = settled()
        done = all_committed()
        while (counted < sent_events or not done) and time.monotonic() < deadline:
            time.sleep(1.0)
            counted, learnt = settled()
            done = all_committed()
        rows_sent = withdrawn = 0.0
        for w in workers:
            rows_sent += pipe.metric(w, "freshrec_gradient_rows_total", outcome="sent")
            withdrawn += pipe.metric(w, "freshrec_gradient_rows_total", outcome="withdrawn")
        applied = pipe.metric("param-server", "freshrec_ps_rows_applied_total")
        # a worker that left took its counters with it: rows sent are known without a leaver
        beyond = None if learnt_by_leaver else max(0, int(applied - rows_sent))
        after = [t for t in load.stats.replies_at if t >= fault_over]
        in_redis = redis_check(pipe, workers)
        waited: dict[str, float] = {}
        for name in pipe.ports:
            if name != "worker-a" or name in workers:
                series = scrape_port(pipe.ports[name]).get("freshrec_redis_unavailable_total", [])
                for labels, value in series:
                    waited[labels["reason"]] = waited.get(labels["reason"], 0) + value
        return {
            "scenario": scenario,
            "events": {
                "produced": sent_events,
                "counted": int(counted),
                "learnt": int(learnt),
                "learnt_twice_at_least": max(0, int(learnt - sent_events)),
                "all_committed": done,
            },
            "requests": {
                "sent": load.stats.sent,
                "answered": load.stats.answered,
                "timed_out": load.stats.timed_out,
                "errors": load.stats.errors,
                "answered_twice": load.stats.answered_twice,
            },
            "gradient_rows": {
                "sent": int(rows_sent),
                "withdrawn": int(withdrawn),
                "applied": int(applied),
                "applied_beyond_sent": beyond,
            },
            "recovery_s": round(after[0] - fault_over, 2) if after else None,
            "failover_s": failover_s,
            "in_redis": in_redis,
            "redis_calls_waited_out": waited,
            "alive": {n: up for n, up in pipe.alive().items() if n != "worker-a" or n in workers},
        }
    finally:
        pipe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--rate", type=float, default=500.0, help="events per second")
    ap.add_argument("--requests", type=float, default=10.0, help="requests per second")
    ap.add_argument("--pause", type=float, default=20.0, help="seconds the broker is frozen")
    ap.add_argument("--outage", type=float, default=10.0, help="seconds Redis is down")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of load before/after")
    ap.add_argument(
        "--message-timeout-ms",
        type=int,
        default=None,
        help="the services' producers give a message up after this long (default librdkafka's "
        "300,000): shorter than --pause makes deliveries fail during it",
    )
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    chosen = [s for s in args.scenarios.split(",") if s]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}: {', '.join(SCENARIOS)}")
    models = train_models(Path(tempfile.mkdtemp(prefix="freshrec-drill-models-")))
    results = []
    for scenario in chosen:
        print(f"== {scenario}", flush=True)
        r = run_scenario(
            scenario,
            models,
            rate=args.rate,
            requests=args.requests,
            pause_s=args.pause,
            outage_s=args.outage,
            settle_s=args.settle,
            message_timeout_ms=args.message_timeout_ms,
        )
        e, q, g = r["events"], r["requests"], r["gradient_rows"]
        print(
            f"   events produced {e['produced']:,} counted {e['counted']:,} learnt {e['learnt']:,}"
            f" | requests sent {q['sent']} answered {q['answered']} timed out {q['timed_out']}"
            f" twice {q['answered_twice']} | gradient rows applied beyond sent "
            f"{g['applied_beyond_sent']} | recovery {r['recovery_s']} s | alive {r['alive']}",
            flush=True,
        )
        results.append(r)
    save(
        "drill_faults",
        {"settings": vars(args) | {"out": str(args.out)}, "scenarios": results},
        args.out,
    )


if __name__ == "__main__":
    main()
