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
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
import redis as redis_lib

from freshcore import clock
from freshcore.kafka import produce
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from freshrec.app.proctime import cpu_seconds, own_cpu_seconds, rss_bytes
from freshrec.promtext import scrape_port, total
from freshrec.sim.pacing import Pacer
from freshrec.sim.produce import DeliveryCounter, events_producer
from tools.benchlib import save
from tools.pipeline import Pipeline, train_models

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


_KEYS = RedisKeys("")  # the drill's pipeline writes without a prefix
ID_FAMILIES = (_KEYS.user_recent(""), _KEYS.answered(""), _KEYS.request_variant(""))
"""Key families with one key per id (``freshcore/rediskeys.py``): counted together."""
TAG = re.compile(r"\{[sg]\d+\}")


def family(key: str) -> str:
    """The family of a FreshRec key: its partition's hash tag and any trailing id as ``*``.

    >>> family("emb:item:{g3}"), family("streams:{s5}:rows"), family("user:recent:u42")
    ('emb:item:{*}', 'streams:{*}:rows', 'user:recent:*')
    """
    for head in ID_FAMILIES:
        if key.startswith(head):
            return head + "*"
    return TAG.sub("{*}", key)


LENGTH = {b"hash": "HLEN", b"list": "LLEN", b"set": "SCARD", b"zset": "ZCARD"}


def redis_families(store) -> dict:
    """What Redis holds, by key family: keys, elements (fields, list entries, members) and
    bytes (``MEMORY USAGE``, exact); with ``INFO``'s split of used memory into dataset and
    overhead and its counts of keys, keys with a TTL and expired keys."""
    keys = list(store.scan_iter(count=1000))
    pipe = store.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
        pipe.memory_usage(key, samples=0)
    answers = pipe.execute()
    pipe = store.pipeline(transaction=False)
    for key, kind in zip(keys, answers[0::2], strict=True):
        # a key gone since the scan is of type none: STRLEN answers 0
        pipe.execute_command(LENGTH.get(kind, "STRLEN"), key)
    lengths = pipe.execute()
    out: dict[str, dict] = {}
    for key, size, length in zip(keys, answers[1::2], lengths, strict=True):
        f = out.setdefault(family(key.decode(errors="replace")), [0, 0, 0])
        f[0] += 1
        f[1] += length or 0
        f[2] += size or 0
    memory, stats, space = store.info("memory"), store.info("stats"), store.info("keyspace")
    db = space.get("db0", {})
    return {
        "families": {
            k: {"keys": v[0], "elements": v[1], "bytes": v[2]} for k, v in sorted(out.items())
        },
        "used_memory": memory["used_memory"],
        "dataset": memory["used_memory_dataset"],
        "overhead": memory["used_memory_overhead"],
        "keys": db.get("keys", 0),
        "keys_with_ttl": db.get("expires", 0),
        "expired_keys": stats.get("expired_keys", 0),
        **{k: v for k, v in stats.items() if "expired" in k and "field" in k},
    }


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
        # each service's resident memory, the streams app's counting process alone too (the
        # rest of it is its validate process), and Redis's used_memory
        series: dict[str, list[tuple[float, float]]] = {
            s: [] for s in (*SERVICES, "streams-counting", "redis")
        }
        # what each stage has read: delivered to the broker (the flood's acks), validated
        # and counted by the streams app, read by the worker
        read: dict[str, list[tuple[float, float]]] = {k: [] for k in READ_SERIES}
        busy: dict[str, list[tuple[float, float]]] = {stage: [] for stage in STAGES}
        # CPU seconds of each service's processes, and of the streams app's counting
        # process alone (its validate stage is a child process)
        cpu: dict[str, list[tuple[float, float]]] = {
            k: [] for k in (*SERVICES, "counting", "broker")
        }
        broker: list[tuple[float, float]] = []  # the embedded broker's RSS: it keeps every record
        held: list[tuple[float, dict]] = []  # what Redis holds by key family, now and then
        # what the streams app holds: items and co-visitation neighbours (all partitions)
        entries: dict[str, list[tuple[float, float]]] = {"items": [], "neighbours": []}
        start = time.monotonic()
        flood.thread.start()
        while (t := time.monotonic() - start) < duration_s:
            for name in SERVICES:
                series[name].append((t, rss_bytes(pipe.procs[name].pid)))
            series["streams-counting"].append((t, rss_bytes(pipe.procs["streams"].pid, own=True)))
            series["redis"].append((t, float(store.info("memory")["used_memory"])))
            streams = scrape_port(pipe.ports["streams"])  # once a sample: the metrics below
            worker = scrape_port(pipe.ports["worker"])
            for key, value in (
                ("delivered", flood.counter.delivered),
                ("validated", total(streams, "freshrec_streams_events_total", outcome="valid")),
                ("counted", total(streams, "freshrec_streams_counted_events_total")),
                ("learnt", total(worker, "freshrec_worker_events_total", outcome="valid")),
            ):
                read[key].append((t, value))
            entries["items"].append((t, total(streams, "freshrec_streams_items")))
            neighbours = total(streams, "freshrec_streams_covisit_neighbours")
            entries["neighbours"].append((t, neighbours))
            for name in SERVICES:
                cpu[name].append((t, cpu_seconds(pipe.procs[name].pid) or 0.0))
            cpu["counting"].append((t, own_cpu_seconds(pipe.procs["streams"].pid) or 0.0))
            cpu["broker"].append((t, own_cpu_seconds(pipe.kafka_pid) or 0.0))
            broker.append((t, rss_bytes(pipe.kafka_pid)))
            for stage in STAGES:
                seconds = total(streams, "freshrec_streams_batch_seconds_sum", stage=stage)
                busy[stage].append((t, seconds))
            print(
                f"  {t:5.0f} s  events {flood.sent:,} "
                + " ".join(f"{k} {v[-1][1]:,.0f}" for k, v in read.items())
                + "  "
                + "  ".join(f"{k} {v[-1][1] / 2**20:,.0f} MiB" for k, v in series.items())
                + f"  broker {broker[-1][1] / 2**20:,.0f} MiB"
                + " held "
                + " ".join(f"{k} {v[-1][1]:,.0f}" for k, v in entries.items())
                + "  busy "
                + " ".join(f"{k} {share(v):.0%}" for k, v in busy.items())
                + "  cpu "
                + " ".join(f"{k} {share(v):.0%}" for k, v in cpu.items()),
                flush=True,
            )
            if redis_every_s and t >= len(held) * redis_every_s:
                held.append((t, redis_families(store)))
                top = sorted(held[-1][1]["families"].items(), key=lambda kv: -kv[1]["bytes"])
                print(
                    "  redis "
                    + "  ".join(
                        f"{k} {v['bytes'] / 2**20:.1f} MiB ({v['keys']:,} keys, {v['elements']:,} elements)"
                        for k, v in top[:6]
                    ),
                    flush=True,
                )
            time.sleep(every_s)
        held.append((time.monotonic() - start, redis_families(store)))
        flood.stop.set()
        flood.thread.join(60)
        evicted = {
            reason: pipe.metric("streams", "freshrec_streams_items_evicted_total", reason=reason)
            for reason in ("idle", "cap")
        }
        return {
            "events": {
                "sent": flood.sent,
                "delivered": flood.counter.delivered,
                "failed": flood.counter.failed,
                "counted": read["counted"][-1][1] if read["counted"] else 0,
            },
            "streams_items_held": pipe.metric("streams", "freshrec_streams_items"),
            "streams_items_evicted": evicted,
            "worker_rows_evicted": pipe.metric("worker", "freshrec_cache_rows_evicted_total"),
            "alive": pipe.alive(),
            "plateau": {k: plateau(v) for k, v in series.items()},
            "series": {k: points(s) for k, s in series.items()},
            "broker_rss_series": points(broker),
            "streams_held_series": {k: points(s) for k, s in entries.items()},
            "redis_families_series": [[round(t, 1), h] for t, h in held],
            **{f"{k}_series": points(s) for k, s in read.items()},
            "stage_seconds_series": {k: points(s, 3) for k, s in busy.items()},
            "cpu_seconds_series": {k: points(s, 2) for k, s in cpu.items()},
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
