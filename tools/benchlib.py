"""Shared plumbing of the benchmarks in tools/: a stack, a fresh prefix, results on disk."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from freshcore import clock
from freshcore.kafka import (
    admin_config,
    consume_available,
    consumer_config,
    produce,
    producer_config,
    profile,
)
from freshcore.lifecycle import settle_heap
from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames, ensure_topics
from freshrec.app.stack import EmbeddedStack, external_services
from freshrec.promtext import histogram_quantile, subtract
from freshrec.sim.world import World, WorldConfig


def learning_world() -> World:
    """The synthetic traffic of ``bench_learning`` and the drills: 1M users, 100k items."""
    return World(WorldConfig(seed=5, n_users=1_000_000, n_items=100_000))


@contextlib.contextmanager
def bench_connection(prefix: str, redis_cluster: int = 0) -> Iterator[ConnectionSettings]:
    """External services when set, else a private embedded stack (its Redis a cluster of
    ``redis_cluster`` masters where that is not 0); topics provisioned."""
    if external_services():
        if redis_cluster:
            raise SystemExit("--redis-cluster starts an embedded cluster; unset REDIS_URL")
        conn = ConnectionSettings.from_env(os.environ).with_prefix(prefix)
        ensure_topics(AdminClient(admin_config(conn)), prefix)
        yield conn
        return
    with tempfile.TemporaryDirectory(prefix="freshrec-bench-") as tmp:
        stack = EmbeddedStack(Path(tmp))
        state = stack.up(detach=False, redis_cluster=redis_cluster)
        try:
            conn = ConnectionSettings.from_env({**state.env, "FRESHREC_TOPIC_PREFIX": prefix})
            ensure_topics(AdminClient(admin_config(conn)), prefix)
            yield conn
        finally:
            stack.down()


@contextlib.contextmanager
def service_process(
    conn: ConnectionSettings, command: str, port: int, extra=None, log: Path | None = None
):
    """``freshrec <command>`` against ``conn`` with metrics on ``port``; stopped on exit.
    Its output goes to ``log`` when given (else nowhere)."""
    env = dict(os.environ)
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=conn.kafka_bootstrap_servers,
        REDIS_URL=conn.redis_url,
        FRESHREC_TOPIC_PREFIX=conn.topic_prefix,
        FRESHREC_METRICS_PORT=str(port),
        **(extra or {}),
    )
    with contextlib.ExitStack() as files:
        out = subprocess.DEVNULL
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = files.enter_context(log.open("w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "freshrec.app.cli", command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def synthetic_records(world, seed: int, n: int) -> list[tuple[bytes, bytes]]:
    """``n`` encoded synthetic events as (key, value), stamped now, ready to pre-produce."""
    from freshrec.sim.traffic import EventSynthesizer
    from schemas.codec import encode_event

    synth = EventSynthesizer(world, seed=seed)
    now = clock.now_ms()
    records: list[tuple[bytes, bytes]] = []
    while len(records) < n:
        records += [(e.user_id.encode(), encode_event(e)) for e in synth.batch(500, now)]
    return records[:n]


def produce_values(
    conn: ConnectionSettings, topic: str, records: list[tuple[bytes, bytes]]
) -> None:
    p = Producer(producer_config(conn, **{"linger.ms": 20}))
    for key, value in records:
        produce(p, topic, value, key)
    if p.flush(60):
        raise RuntimeError("benchmark input not delivered")


def events_on_own_topics(
    conn: ConnectionSettings, prefix: str, records: list[tuple[bytes, bytes]]
) -> ConnectionSettings:
    """``records`` on the ``events`` topic of a topic set of their own (``prefix``, topics
    provisioned) on ``conn``'s broker; the connection to it. A new consumer group, or a reader
    that must not meet another phase's batches, reads there."""
    own = conn.with_prefix(prefix)
    ensure_topics(AdminClient(admin_config(own)), prefix)
    produce_values(own, TopicNames(prefix).events, records)
    return own


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``): a streams instance is two processes."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` and its descendants for the block, SIGCONT after: a warmed-up service
    finds a backlog waiting when it resumes, as a consumer that starts on one does."""
    pids = process_tree(pid)
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


def raw_consume_rate(conn: ConnectionSettings, topic: str, expected: int) -> float:
    """Messages/s of a confluent-kafka batch consumer reading ``expected`` messages."""
    c = Consumer(consumer_config(conn, f"{conn.topic_prefix}raw-{time.time_ns()}"))
    c.subscribe([topic])
    n, first = 0, None
    deadline = time.monotonic() + 120
    while n < expected and time.monotonic() < deadline:
        msgs = c.consume(10_000, 0.1)
        n += sum(1 for m in msgs if not m.error())
        if msgs and first is None:
            # the clock starts once the first batch is in hand (the group join is not
            # consumption), so that batch is not counted either
            first = (time.perf_counter(), n)
    end = time.perf_counter()
    c.close()
    if n < expected or first is None:
        raise RuntimeError(f"raw consumer read {n} of {expected}")
    return (n - first[1]) / (end - first[0])


def raw_consume_best(
    conn: ConnectionSettings, topic: str, expected: int, reads: int = 3
) -> tuple[float, list[float]]:
    """The fastest of ``reads`` raw consume rates of the same messages (each a fresh group),
    and all of them. One read of 200k messages lasts a fraction of a second, and single reads
    ranged from 0.34M to 1.2M messages/s within an hour on the development machine; noise
    only slows a read, so the fastest is the best estimate of what a plain consumer does, and
    the conservative denominator for a pipeline's share of it (a median read low and flattered
    the ratio: 15-20% against 11-12.5% for the same runs of the worker).

    This process's heap is frozen first (``settle_heap``, as every FreshRec service freezes
    its own at start): otherwise the cyclic collector, set off by the Message objects a read
    creates, walks the benchmark's long-lived objects during each read. In ``bench_streams``'
    process (~50,000 of them) reads of 200,000 events ran at 1.06-1.09M/s, frozen at
    1.23-1.36M/s; in ``bench_learning``'s, with torch's, at about half (2026-12-01 (61c523a))."""
    settle_heap()
    rates = [raw_consume_rate(conn, topic, expected) for _ in range(reads)]
    return max(rates), [round(r) for r in rates]


def partition_ends(conn: ConnectionSettings, topic: str) -> dict[int, int]:
    """One past the last offset of each partition of ``topic``, read back from the topic (the
    embedded broker does not answer offset queries reliably)."""
    c = Consumer(consumer_config(conn, None))
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    ends = {p: 0 for p in parts}
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 3.0:
        msgs = c.consume(10_000, 0.2)
        for msg in msgs:
            if msg.error() is None:
                ends[msg.partition()] = max(ends[msg.partition()], msg.offset() + 1)
        if msgs:
            quiet_since = time.monotonic()
    c.close()
    return ends


def committed(conn: ConnectionSettings, group: str, topic: str, partitions) -> dict[int, int]:
    """The group's committed offsets (a consumer that names the group but never joins it)."""
    c = Consumer(consumer_config(conn, group))
    got = c.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
    c.close()
    return {tp.partition: tp.offset for tp in got}


class LagReader:
    """A plain confluent-kafka consumer (group-less, every partition of ``events`` from the
    beginning, polling with the profile's fetch wait like the worker) that records, for each
    event stamped at or after ``measured_from_ms``, event time -> read."""

    def __init__(self, conn: ConnectionSettings, measured_from_ms: float = float("inf")) -> None:
        topic = TopicNames(conn.topic_prefix).events
        self.consumer = Consumer(consumer_config(conn, None))
        parts = self.consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        self.measured_from_ms = measured_from_ms
        self.lags: list[float] = []
        self.sent: list[int] = []
        # read as the worker reads (consume_available: back with the first message, at most
        # the profile's fetch wait for none)
        self.poll_s = profile(conn).fetch_wait_max_ms / 1000

    def read(self, until, give_up_at) -> None:
        """Read until ``until()`` says enough or ``give_up_at()`` (monotonic) has passed."""
        import orjson

        while not until() and time.monotonic() < give_up_at():
            for m in consume_available(self.consumer, 10_000, self.poll_s):
                if m.error() is None:
                    ts = orjson.loads(m.value())["ts_ms"]
                    if ts >= self.measured_from_ms:
                        self.lags.append(time.time() * 1000 - ts)
                        self.sent.append(ts)

    def summary(self) -> dict:
        self.consumer.close()
        return lag_summary(self.lags, self.sent)


def lag_summary(lags, sent) -> dict:
    """p50/p99 of ``lags`` (ms), and of the first and last 5 s of the phase by event time
    ``sent``: Tansu slows as a partition's record batches pile up (docs/operations.md)."""
    import numpy as np

    a, t = np.asarray(lags), np.asarray(sent)
    first, last = a[t < t.min() + 5000], a[t > t.max() - 5000]
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 1),
        "p99_ms": round(float(np.percentile(a, 99)), 1),
        "first_5s_p50_p99_ms": [round(float(np.percentile(first, q)), 1) for q in (50, 99)],
        "last_5s_p50_p99_ms": [round(float(np.percentile(last, q)), 1) for q in (50, 99)],
        "events": len(a),
    }


def raw_lag(
    conn: ConnectionSettings,
    records: list,
    rate_per_s: float,
    ramp: list = (),
    linger_ms: int | None = None,
) -> dict[str, float]:
    """The floor under any pipeline's lag: event time -> a plain consumer (``LagReader``),
    with ``records`` from ``freshrec.sim.produce.prepare_events`` sent at ``rate_per_s`` as in the
    measured phase, after the ``ramp`` records (sent first at the same rate, not measured, as
    in the pipeline's phase). Give it a connection of its own: it reads ``events`` from the
    beginning."""
    from freshrec.sim.produce import events_producer, produce_prepared

    reader = LagReader(conn)
    done, give_up = threading.Event(), [float("inf")]
    thread = threading.Thread(
        target=reader.read,
        args=(lambda: done.is_set() and len(reader.lags) >= len(records), lambda: give_up[0]),
        daemon=True,
    )
    thread.start()
    producer = events_producer(conn, linger_ms)  # one session for both phases, as the pipeline's
    if ramp:
        produce_prepared(conn, list(ramp), rate_per_s=rate_per_s, producer=producer)
    # whole milliseconds, as events are stamped: a float mark could exclude the first event
    # stamped in the same millisecond (a run failed reading 149,999 of 150,000)
    reader.measured_from_ms = clock.now_ms()
    produce_prepared(conn, records, rate_per_s=rate_per_s, producer=producer)
    give_up[0] = time.monotonic() + 10
    done.set()
    thread.join()
    if len(reader.lags) < len(records):
        raise RuntimeError(f"raw lag consumer read {len(reader.lags)} of {len(records)}")
    return reader.summary()


def lag_alongside(conn: ConnectionSettings, stop, out: str) -> None:
    """Process target: a ``LagReader`` of every event beside a running pipeline, on the same
    broker, until ``stop`` (a multiprocessing event) is set; writes event times and lags to
    ``out`` (``.npy``, two rows) for ``lag_summary``. What a plain consumer waits there is
    the broker's share of the pipeline's lag, under the pipeline's load."""
    import numpy as np

    reader = LagReader(conn, measured_from_ms=0)
    reader.read(stop.is_set, lambda: float("inf"))
    reader.consumer.close()
    np.save(out, np.array([reader.sent, reader.lags], np.float64))


def p50_p99(base, after, name: str, digits: int = 1, **labels: str) -> dict[str, float]:
    """p50 and p99 (ms) of histogram ``name`` over what it observed between two scrapes."""
    delta = subtract(after, base, name + "_bucket")
    return {
        f"p{q}_ms": round(1000 * histogram_quantile(delta, name, q / 100, **labels), digits)
        for q in (50, 99)
    }


def median_ms(fn, repeats: int, warmup: int = 1) -> float:
    """The median wall time of ``repeats`` calls of ``fn``, in ms, after ``warmup`` calls."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def device_arg(ap, text: str):
    """The torch device ``text`` names (``auto``: CUDA when there is one), or the parser's
    error when this host cannot use it (e.g. ``cuda`` on a CPU-only build of torch)."""
    import torch

    from inference.device import pick_device

    try:
        device = pick_device(text)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        ap.error(f"--device {text}: {exc}")
    return device


def save(name: str, results: dict, out_dir: Path = Path("artifacts")) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **results,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"saved {path}")
    return path


def wait_until(condition, timeout_s: float, what: str, errors: list | tuple = ()):
    """Poll ``condition`` until it is truthy and return it; stop with ``what`` after
    ``timeout_s`` (``errors``: exceptions a thread reported, raised at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if errors:
            raise errors[0]
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)
