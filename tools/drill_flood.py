"""Drill: a flood of ids never seen before, and whether memory stops growing.

Runs the streams app, the parameter server and a worker as their own processes on a private
broker and Redis (``tools/pipeline.py``), then produces valid click events at ``--rate`` per
second for ``--duration`` seconds, each naming a new item id with probability
``--new-items`` (else one of the last thousand named) and a new user id with probability
``--new-users`` (else a recent one, so users click several items and make co-visitation
pairs). Every ``--every`` seconds it samples each service's resident memory (the process and
its children, from ``/proc``) and Redis's ``used_memory``; and, so that a level is read as a
plateau only while the services keep up, the events delivered to the broker, validated and
counted by the streams app and read by the worker, the share of each interval the streams
stages spent in batches, and the CPU of each service, of the streams app's counting process
and of the embedded broker (with its resident memory: it keeps every record).

The services run with every bound this flood meets set low, so that they bind within the
drill (``BOUNDS``): the streams app's items per partition, the worker's item table, user
rows, the rows both let go to host RAM, and users whose recent and consumed items it
remembers, the dedupe windows, the co-visitation users and the neighbours counted over a
partition's anchors, and a row TTL of a minute for what only a TTL bounds (rows and recent
clicks in Redis, rows in the parameter server's memory). A bound that holds shows as a
plateau: the report gives each series' level at a third, two thirds and the end of the
flood, and its growth over the last third against its level. Every ``--redis-every``
seconds it also takes what Redis holds by key family (keys, fields or entries, and bytes by
``MEMORY USAGE``), so that a growing ``used_memory`` can be traced to what grows.

The services wait 100-500 ms in their fetches (``KAFKA_PROFILES``; ``--kafka-profile local``
for the local defaults, under which the embedded broker leaves a consumer that falls behind
without answers).

    .venv/bin/python -m tools.drill_flood [--rate 2000] [--duration 240] [--every 5]

Writes artifacts/drill_flood.json (``--out``) and the plot ``--plot``
(docs/drill_flood.png). Needs nothing running.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
import redis as redis_lib

from freshcore import clock
from freshcore.kafka import produce
from freshcore.topics import TopicNames
from freshrec.app.proctime import cpu_seconds, own_cpu_seconds, rss_bytes
from freshrec.promtext import scrape_port, total
from freshrec.sim.pacing import Pacer
from freshrec.sim.produce import DeliveryCounter, events_producer
from tools.benchlib import save
from tools.pipeline import Pipeline, train_models
from tools.redis_families import redis_families

BOUNDS = {
    "FRESHREC_STREAMS_MAX_ITEMS": "5000",
    "FRESHREC_MAX_ITEM_ROWS": "20000",
    "FRESHREC_USER_CACHE_ROWS": "20000",
    "FRESHREC_HOST_USER_ROWS": "20000",
    "FRESHREC_HOST_ITEM_ROWS": "20000",
    "FRESHREC_RECENT_USERS": "20000",
    "FRESHREC_SEEN_USERS": "20000",
    "FRESHREC_DEDUPE_WINDOW": "20000",
    "FRESHREC_COVISIT_USERS": "20000",
    "FRESHREC_COVISIT_MAX_NEIGHBOURS": "10000",
    "FRESHREC_ROW_TTL_S": "60",
}
"""Each bound the flood meets, set so that it binds within a few minutes."""

PRODUCTION = {"FRESHREC_KAFKA_PROFILE": "production", "FRESHREC_KAFKA_SESSION_TIMEOUT_MS": "6000"}
KAFKA_PROFILES = {
    "drill": {
        **PRODUCTION,
        "FRESHREC_WORKER_FETCH_WAIT_MS": "500",
        "FRESHREC_STREAMS_FETCH_WAIT_MS": "500",
    },
    "production": PRODUCTION,
    "local": {"FRESHREC_KAFKA_PROFILE": "local"},
}
"""The services' Kafka client timings (``--kafka-profile``). On the embedded broker a consumer
whose fetch wait is shorter than the broker's walk of a partition full of small batches gets
empty answers once it falls behind, and stays behind (docs/operations.md, "The embedded
broker"); the drill would then measure idle services. At the ``local`` profile's 10-20 ms the
worker stopped learning about 140 s into a flood of 2,000 events/s; at ``production``'s
100 ms it kept up to about 500 s. ``drill`` (the default) adds 500 ms waits for the worker's
and the counting stage's consumers, which read the most: a flood has no requests whose
latency a long wait would cost. The session timeout stays at 6 s, as this broker needs for
a quick group join."""

SERVICES = ("streams", "param-server", "worker")
STAGES = ("validate", "count", "publish")
"""The streams app's stages whose busy time is sampled (seconds spent in batches)."""


class Flood:
    """Click events naming new ids, produced at a steady rate from a thread of its own."""

    def __init__(self, pipe: Pipeline, rate: float, new_items: float, new_users: float) -> None:
        self.pipe, self.rate = pipe, rate
        self.new_items, self.new_users = new_items, new_users
        self.stop = threading.Event()
        self.counter = DeliveryCounter()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(7)
        topic = TopicNames(self.pipe.conn.topic_prefix).events
        producer = events_producer(self.pipe.conn)
        items: list[str] = []
        users: list[str] = []

        def pick(recent: list[str], p_new: float) -> str:
            if not recent or rng.random() < p_new:
                recent.append(uuid.uuid4().hex)
                del recent[:-1000]
                return recent[-1]
            return rng.choice(recent)

        pacer = Pacer(self.rate, time.monotonic())
        while not self.stop.is_set():
            want = pacer.to_send(time.monotonic(), self.sent)
            now_ms = clock.now_ms()
            for _ in range(want):
                user = pick(users, self.new_users)
                event = {
                    "event_id": uuid.uuid4().hex,
                    "event_type": "click",
                    "user_id": user,
                    "item_id": pick(items, self.new_items),
                    "ts_ms": now_ms,
                    "schema_version": 1,
                }
                produce(
                    producer, topic, orjson.dumps(event), user.encode(), on_delivery=self.counter
                )
            self.sent += want
            producer.poll(0)
            self.stop.wait(0.01)
        producer.flush(30)


READ_SERIES = {
    "delivered": "delivered to the broker",
    "validated": "validated (streams)",
    "counted": "counted (streams)",
    "learnt": "read by the worker",
}
"""What each stage has read (saved as ``{key}_series``), plotted under the memory: a level is
a plateau under load only while these keep up with the events delivered."""


def points(samples: list[tuple[float, float]], digits: int | None = None) -> list[list]:
    """A series as saved: seconds to 0.1, values whole (or to ``digits``)."""
    return [[round(t, 1), int(v) if digits is None else round(v, digits)] for t, v in samples]


def share(samples: list[tuple[float, float]]) -> float:
    """The last sampling interval's growth of a series of cumulative seconds, per second of
    the interval (0 before two samples): the share of it a stage spent in batches, or a
    process on a CPU. Near 100% a stage is the bottleneck; low while its input waits, not.

    >>> share([(0.0, 1.0), (10.0, 4.0), (30.0, 5.0)])
    0.05
    >>> share([(0.0, 1.0)])
    0.0
    """
    if len(samples) < 2 or samples[-1][0] <= samples[-2][0]:
        return 0.0
    return (samples[-1][1] - samples[-2][1]) / (samples[-1][0] - samples[-2][0])


def plateau(samples: list[tuple[float, float]]) -> dict:
    """A series' level at a third, two thirds and the end, and its growth over the last
    third as a share of its level there."""
    n = len(samples)
    at = [samples[min(n - 1, max(0, round(n * f) - 1))][1] for f in (1 / 3, 2 / 3, 1.0)]
    growth = (at[2] - at[1]) / at[1] if at[1] else None
    return {
        "third": at[0],
        "two_thirds": at[1],
        "end": at[2],
        "last_third_growth": None if growth is None else round(growth, 4),
    }


class FloodSamples:
    """What the drill samples, each a series of (seconds into the flood, value)."""

    def __init__(self) -> None:
        # each service's resident memory, the streams app's counting process alone too (the
        # rest of it is its validate process), and Redis's used_memory
        self.series: dict[str, list[tuple[float, float]]] = {
            s: [] for s in (*SERVICES, "streams-counting", "redis")
        }
        # what each stage has read: delivered to the broker (the flood's acks), validated
        # and counted by the streams app, read by the worker
        self.read: dict[str, list[tuple[float, float]]] = {k: [] for k in READ_SERIES}
        self.busy: dict[str, list[tuple[float, float]]] = {stage: [] for stage in STAGES}
        # CPU seconds of each service's processes, and of the streams app's counting
        # process alone (its validate stage is a child process)
        self.cpu: dict[str, list[tuple[float, float]]] = {
            k: [] for k in (*SERVICES, "counting", "broker")
        }
        # the embedded broker's RSS: it keeps every record
        self.broker: list[tuple[float, float]] = []
        self.held: list[tuple[float, dict]] = []  # what Redis holds by key family, now and then
        # what the streams app holds: items and co-visitation neighbours (all partitions)
        self.entries: dict[str, list[tuple[float, float]]] = {"items": [], "neighbours": []}

    def take(self, t: float, pipe: Pipeline, store, delivered: int) -> None:
        """One sample of every series at ``t``; ``delivered``: the flood's acks so far."""
        for name in SERVICES:
            self.series[name].append((t, rss_bytes(pipe.procs[name].pid)))
        self.series["streams-counting"].append((t, rss_bytes(pipe.procs["streams"].pid, own=True)))
        self.series["redis"].append((t, float(store.info("memory")["used_memory"])))
        streams = scrape_port(pipe.ports["streams"])  # once a sample: the metrics below
        worker = scrape_port(pipe.ports["worker"])
        for key, value in (
            ("delivered", delivered),
            ("validated", total(streams, "freshrec_streams_events_total", outcome="valid")),
            ("counted", total(streams, "freshrec_streams_counted_events_total")),
            ("learnt", total(worker, "freshrec_worker_events_total", outcome="valid")),
        ):
            self.read[key].append((t, value))
        self.entries["items"].append((t, total(streams, "freshrec_streams_items")))
        neighbours = total(streams, "freshrec_streams_covisit_neighbours")
        self.entries["neighbours"].append((t, neighbours))
        for name in SERVICES:
            self.cpu[name].append((t, cpu_seconds(pipe.procs[name].pid) or 0.0))
        self.cpu["counting"].append((t, own_cpu_seconds(pipe.procs["streams"].pid) or 0.0))
        self.cpu["broker"].append((t, own_cpu_seconds(pipe.kafka_pid) or 0.0))
        self.broker.append((t, rss_bytes(pipe.kafka_pid)))
        for stage in STAGES:
            seconds = total(streams, "freshrec_streams_batch_seconds_sum", stage=stage)
            self.busy[stage].append((t, seconds))

    def line(self, t: float, sent: int) -> str:
        """The last sample, as the drill prints it."""
        return (
            f"  {t:5.0f} s  events {sent:,} "
            + " ".join(f"{k} {v[-1][1]:,.0f}" for k, v in self.read.items())
            + "  "
            + "  ".join(f"{k} {v[-1][1] / 2**20:,.0f} MiB" for k, v in self.series.items())
            + f"  broker {self.broker[-1][1] / 2**20:,.0f} MiB"
            + " held "
            + " ".join(f"{k} {v[-1][1]:,.0f}" for k, v in self.entries.items())
            + "  busy "
            + " ".join(f"{k} {share(v):.0%}" for k, v in self.busy.items())
            + "  cpu "
            + " ".join(f"{k} {share(v):.0%}" for k, v in self.cpu.items())
        )

    def held_line(self) -> str:
        """The six largest key families of the last look at what Redis holds."""
        top = sorted(self.held[-1][1]["families"].items(), key=lambda kv: -kv[1]["bytes"])
        return "  redis " + "  ".join(
            f"{k} {v['bytes'] / 2**20:.1f} MiB ({v['keys']:,} keys, {v['elements']:,} elements)"
            for k, v in top[:6]
        )

    def saved(self) -> dict:
        """The series as the results hold them, with each memory series' plateau."""
        return {
            "plateau": {k: plateau(v) for k, v in self.series.items()},
            "series": {k: points(s) for k, s in self.series.items()},
            "broker_rss_series": points(self.broker),
            "streams_held_series": {k: points(s) for k, s in self.entries.items()},
            "redis_families_series": [[round(t, 1), h] for t, h in self.held],
            **{f"{k}_series": points(s) for k, s in self.read.items()},
            "stage_seconds_series": {k: points(s, 3) for k, s in self.busy.items()},
            "cpu_seconds_series": {k: points(s, 2) for k, s in self.cpu.items()},
        }


def run(
    rate: float,
    duration_s: float,
    every_s: float,
    new_items: float,
    new_users: float,
    kafka_profile: str = "drill",
    redis_every_s: float = 300.0,
):
    models = train_models(Path(tempfile.mkdtemp(prefix="freshrec-flood-models-")))
    workdir = Path(tempfile.mkdtemp(prefix="freshrec-flood-"))
    pipe = Pipeline(workdir, models, message_timeout_ms=0)
    pipe.env.update(BOUNDS)
    pipe.env.update(KAFKA_PROFILES[kafka_profile])
    try:
        for name in SERVICES:
            pipe.start(name, name)
        pipe.wait_assigned(list(SERVICES))
        store = redis_lib.Redis.from_url(pipe.redis.url)
        flood = Flood(pipe, rate, new_items, new_users)
        samples = FloodSamples()
        start = time.monotonic()
        flood.thread.start()
        while (t := time.monotonic() - start) < duration_s:
            samples.take(t, pipe, store, flood.counter.delivered)
            print(samples.line(t, flood.sent), flush=True)
            if redis_every_s and t >= len(samples.held) * redis_every_s:
                samples.held.append((t, redis_families(store)))
                print(samples.held_line(), flush=True)
            time.sleep(every_s)
        samples.held.append((time.monotonic() - start, redis_families(store)))
        flood.stop.set()
        flood.thread.join(60)
        evicted = {
            reason: pipe.metric("streams", "freshrec_streams_items_evicted_total", reason=reason)
            for reason in ("idle", "cap")
        }
        counted = samples.read["counted"]
        return {
            "events": {
                "sent": flood.sent,
                "delivered": flood.counter.delivered,
                "failed": flood.counter.failed,
                "counted": counted[-1][1] if counted else 0,
            },
            "streams_items_held": pipe.metric("streams", "freshrec_streams_items"),
            "streams_items_evicted": evicted,
            "worker_rows_evicted": pipe.metric("worker", "freshrec_cache_rows_evicted_total"),
            "alive": pipe.alive(),
            **samples.saved(),
        }
    finally:
        pipe.close()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    read = {
        label: result[f"{k}_series"]
        for k, label in READ_SERIES.items()
        if result.get(f"{k}_series")
    }
    rows = 2 if read else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 4.5 * rows), sharex=True, squeeze=False)
    ax = axes[0][0]
    for name, points in result["series"].items():
        ax.plot([t for t, _ in points], [v / 2**20 for _, v in points], label=name)
    ax.set_ylabel("resident memory, MiB (Redis: used_memory)")
    ax.set_title(
        f"{result['events']['sent']:,} events naming new ids "
        f"({result['settings']['rate']:,.0f}/s), bounds set low"
    )
    ax.legend()
    ax.grid(alpha=0.3)
    if read:
        below = axes[1][0]
        for label, points in read.items():
            below.plot([t for t, _ in points], [v / 1e6 for _, v in points], label=label)
        below.set_ylabel("events, millions")
        below.legend()
        below.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds of flood")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="events per second")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of flood")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--new-items", type=float, default=0.8, help="share of events, new item")
    ap.add_argument("--new-users", type=float, default=0.5, help="share of events, new user")
    ap.add_argument(
        "--kafka-profile",
        choices=sorted(KAFKA_PROFILES),
        default="drill",
        help="the services' Kafka client timings (KAFKA_PROFILES; drill: 100-500 ms waits)",
    )
    ap.add_argument(
        "--redis-every",
        type=float,
        default=300.0,
        help="seconds between samples of what Redis holds by key family (0: none)",
    )
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    ap.add_argument("--plot", type=Path, default=Path("docs/drill_flood.png"))
    args = ap.parse_args()
    result = run(
        args.rate,
        args.duration,
        args.every,
        args.new_items,
        args.new_users,
        args.kafka_profile,
        args.redis_every,
    )
    result["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["bounds"] = BOUNDS
    plot(result, args.plot)
    save("drill_flood", result, args.out)


if __name__ == "__main__":
    main()
