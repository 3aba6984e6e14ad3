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
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis as redis_lib

from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames
from freshrec.client import RecommendClient, RecommendTimeout
from freshrec.promtext import scrape_port
from tools.benchlib import committed, partition_ends, save
from tools.pipeline import WORLD, BackgroundEvents, Pipeline, train_models
from tools.state_audit import redis_check

SCENARIOS = ("broker_pause", "redis_restart", "redis_full", "rebalance", "cluster_failover")


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


@dataclass
class Fault:
    """What a scenario's fault leaves for its report."""

    workers: list[str]
    """The workers in the group once it is over."""
    learnt_by_leaver: float = 0.0
    """Events the worker that left had learnt just before it left (``rebalance``)."""
    failover_s: float | None = None
    """Seconds until the replica of the killed master was a master (``cluster_failover``)."""


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
    try:
        pipe.start("streams", "streams")
        pipe.start("param-server", "param-server")
        pipe.start("worker-a", "worker")
        pipe.wait_assigned(["streams", "param-server", "worker-a"])
        load = RequestLoop(pipe.conn, requests)
        events = BackgroundEvents(pipe.conn, rate)
        events.start()
        load.thread.start()
        time.sleep(settle_s)  # a steady load before the fault
        fault = inflict(scenario, pipe, pause_s=pause_s, outage_s=outage_s, settle_s=settle_s)
        fault_over = time.monotonic()
        time.sleep(settle_s)  # the load goes on after it
        produced = events.stop(60)
        load.stop.set()
        load.thread.join(60)
        return report(scenario, pipe, fault, produced.delivered, load.stats, fault_over)
    finally:
        pipe.close()


def inflict(
    scenario: str, pipe: Pipeline, *, pause_s: float, outage_s: float, settle_s: float
) -> Fault:
    """The scenario's fault, start to end (the module's docstring); what it leaves."""
    fault = Fault(workers=["worker-a"])
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
        fault.failover_s = round(pipe.redis.kill_first_master(), 2)
        time.sleep(outage_s)
    elif scenario == "rebalance":
        pipe.start("worker-b", "worker")
        fault.workers.append("worker-b")
        pipe.wait_assigned(["worker-b"])
        time.sleep(settle_s)
        fault.learnt_by_leaver = pipe.metric(
            "worker-a", "freshrec_worker_events_total", outcome="valid"
        )
        pipe.procs["worker-a"].send_signal(signal.SIGTERM)  # it leaves the group
        pipe.procs["worker-a"].wait(60)
        fault.workers.remove("worker-a")
    else:
        raise ValueError(f"no such scenario: {scenario}")
    return fault


def settle(pipe: Pipeline, fault: Fault, produced: int) -> tuple[float, float, bool]:
    """Events counted by the streams app and learnt by the workers, and whether the workers'
    group committed every ``events`` partition to its end, once all ``produced`` are counted
    and committed (or two minutes have passed)."""

    def settled() -> tuple[float, float]:
        counted = pipe.metric("streams", "freshrec_streams_counted_events_total")
        learnt = fault.learnt_by_leaver + sum(
            pipe.metric(w, "freshrec_worker_events_total", outcome="valid") for w in fault.workers
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
    while (counted < produced or not done) and time.monotonic() < deadline:
        time.sleep(1.0)
        counted, learnt = settled()
        done = all_committed()
    return counted, learnt, done


def gradient_rows(pipe: Pipeline, fault: Fault) -> dict:
    """Gradient rows the workers sent and withdrew, and those the parameter server applied."""
    rows_sent = withdrawn = 0.0
    for w in fault.workers:
        rows_sent += pipe.metric(w, "freshrec_gradient_rows_total", outcome="sent")
        withdrawn += pipe.metric(w, "freshrec_gradient_rows_total", outcome="withdrawn")
    applied = pipe.metric("param-server", "freshrec_ps_rows_applied_total")
    # a worker that left took its counters with it: rows sent are known without a leaver
    beyond = None if fault.learnt_by_leaver else max(0, int(applied - rows_sent))
    return {
        "sent": int(rows_sent),
        "withdrawn": int(withdrawn),
        "applied": int(applied),
        "applied_beyond_sent": beyond,
    }


def redis_waits(pipe: Pipeline, fault: Fault) -> dict[str, float]:
    """The Redis calls the services still running waited out, by reason."""
    waited: dict[str, float] = {}
    for name in pipe.ports:
        if name != "worker-a" or name in fault.workers:
            series = scrape_port(pipe.ports[name]).get("freshrec_redis_unavailable_total", [])
            for labels, value in series:
                waited[labels["reason"]] = waited.get(labels["reason"], 0) + value
    return waited


def report(
    scenario: str,
    pipe: Pipeline,
    fault: Fault,
    produced: int,
    stats: RequestStats,
    fault_over: float,
) -> dict:
    """The scenario's figures (the module's docstring), once the services have settled."""
    counted, learnt, done = settle(pipe, fault, produced)
    rows = gradient_rows(pipe, fault)
    after = [t for t in stats.replies_at if t >= fault_over]
    in_redis = redis_check(pipe, fault.workers)
    waited = redis_waits(pipe, fault)
    return {
        "scenario": scenario,
        "events": {
            "produced": produced,
            "counted": int(counted),
            "learnt": int(learnt),
            "learnt_twice_at_least": max(0, int(learnt - produced)),
            "all_committed": done,
        },
        "requests": {
            "sent": stats.sent,
            "answered": stats.answered,
            "timed_out": stats.timed_out,
            "errors": stats.errors,
            "answered_twice": stats.answered_twice,
        },
        "gradient_rows": rows,
        "recovery_s": round(after[0] - fault_over, 2) if after else None,
        "failover_s": fault.failover_s,
        "in_redis": in_redis,
        "redis_calls_waited_out": waited,
        "alive": {n: up for n, up in pipe.alive().items() if n != "worker-a" or n in fault.workers},
    }


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
