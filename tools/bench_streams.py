"""Benchmark of ``freshrec streams``: throughput vs raw consume, and hot-list lag at 5k/s.

    .venv/bin/python -m tools.bench_streams [--events 500000] [--rate 5000] [--duration 30]

Writes artifacts/bench_streams.json. Runs on its own embedded stack (or on
KAFKA_BOOTSTRAP_SERVERS/REDIS_URL when set).
"""

from __future__ import annotations

import argparse
import time

from freshcore.kafka import close_producer
from freshcore.topics import TopicNames
from freshrec.app.stack import free_port
from freshrec.progress import ProgressLine
from freshrec.promtext import scrape, subtract, total
from freshrec.sim.produce import events_producer, prepare_events, produce_prepared
from freshrec.sim.world import World, WorldConfig
from tools.benchlib import (
    bench_connection,
    events_on_own_topics,
    p50_p99,
    paused,
    produce_values,
    raw_consume_best,
    raw_lag,
    save,
    service_process,
    synthetic_records,
)

COUNTED = "freshrec_streams_counted_events_total"


def metric(port: int, name: str, **labels) -> float:
    """One metric's total, scraped alone (``?name[]=``: polling costs the instance little)."""
    try:
        return total(scrape(f"http://127.0.0.1:{port}/metrics?name[]={name}"), name, **labels)
    except OSError:
        return 0.0


def wait_for(port: int, proc, name: str, n: float, timeout_s: float, progress) -> float:
    """Until the instance's metric ``name`` reaches ``n`` (or it exited, or ``timeout_s``
    passed); returns the value reached."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(port, name)) < n:
        if proc.poll() is not None:
            raise SystemExit(f"freshrec streams exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} reached {value:,.0f} of {n:,.0f} in {timeout_s:.0f} s")
        progress.update(f"{name}: {value:,.0f}/{n:,.0f}")
        time.sleep(0.02)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=500_000)
    ap.add_argument("--rate", type=float, default=5000.0)
    ap.add_argument("--duration", type=float, default=30.0)
    args = ap.parse_args()
    progress = ProgressLine()
    world = World(WorldConfig(seed=3, n_users=1_000_000, n_items=100_000))
    results: dict = {}

    records = synthetic_records(world, 3, args.events)
    warm = prepare_events(world, 200, seed=99)
    rate, raw, raw_reads = warm_rate(records, warm, progress)
    progress.done(
        f"raw confluent-kafka batch consume: {raw:,.0f} events/s (fastest of {raw_reads})"
    )
    progress.done(f"freshrec streams: {rate:,.0f} events/s ({100 * rate / raw:.1f}% of raw)")
    cold = cold_rate(records, progress)
    if cold is None:
        progress.done(
            "freshrec streams from a cold start: not timed, every event was validated "
            "by the first look (use more --events)"
        )
    else:
        progress.done(f"freshrec streams from a cold start: {cold:,.0f} events/s")
    results["throughput"] = {
        "events": len(records),
        "raw_consume_events_per_s": round(raw),
        "raw_consume_reads": raw_reads,
        "streams_events_per_s": round(rate),
        "ratio": round(rate / raw, 3),
        "cold_start_events_per_s": None if cold is None else round(cold),
        "cold_start_ratio": None if cold is None else round(cold / raw, 3),
    }
    results["hot_list_lag"] = hot_list_lag(world, warm, args, progress)
    save("bench_streams", results)


def warm_rate(records: list, warm: list, progress) -> tuple[float, float, list[float]]:
    """Events/s of a warmed-up instance over ``records``, and the raw consume rates of the
    same events (the fastest, and every read)."""
    # the streams rate on a warmed-up instance (both stages' consumer groups joined, as the
    # raw consumer's clock also starts after its join): it is paused while the events are
    # produced, so it finds the whole backlog on resuming, like the raw consumer does
    with bench_connection(f"bs{int(time.time())}.") as conn:
        topic = TopicNames(conn.topic_prefix).events
        port = free_port()
        with service_process(conn, "streams", port) as proc:
            produce_prepared(conn, warm, rate_per_s=200)
            wait_for(port, proc, COUNTED, len(warm), 60, progress)
            with paused(proc.pid):
                produce_values(conn, topic, records)
                progress.done(f"produced {len(records):,} events (instance paused)")
            start = time.perf_counter()
            wait_for(port, proc, COUNTED, len(warm) + len(records), 600, progress)
            rate = len(records) / (time.perf_counter() - start)
        # the raw reads get what the timed instance read: the same events on a topic of their
        # own, without the warm-up's head of one-event batches, which the instance had read
        # before its clock started (on the embedded broker that head alone took a raw read of
        # 500,000 events from 1.76-1.90M to 1.20-1.39M events/s: scratch runs, 2026-12-01 (61c523a))
        plain = events_on_own_topics(conn, conn.topic_prefix + "raw.", records)
        raw, raw_reads = raw_consume_best(
            plain, TopicNames(plain.topic_prefix).events, len(records)
        )
    return rate, raw, raw_reads


def cold_rate(records: list, progress) -> float | None:
    """Events/s of an instance started on the backlog of ``records``, from the first event
    its validate stage took (None when it had taken them all by the first look)."""
    # and from a cold start on the backlog: the count stage's consumer group joins (seconds
    # on the embedded broker) after the validate stage has begun, inside the timed span
    with bench_connection(f"bc{int(time.time())}.") as conn:
        topic = TopicNames(conn.topic_prefix).events
        produce_values(conn, topic, records)
        port = free_port()
        with service_process(conn, "streams", port) as proc:
            # from the first event the validate stage took: counting starts later
            validated = wait_for(port, proc, "freshrec_streams_events_total", 1, 600, progress)
            start = time.perf_counter()
            wait_for(port, proc, COUNTED, len(records), 600, progress)
            # None: the validate stage had taken them all by the first look (too few events)
            cold = None
            if validated < len(records):
                cold = (len(records) - validated) / (time.perf_counter() - start)
    return cold


def hot_list_lag(world, warm: list, args, progress) -> dict:
    """Event time -> hot list at ``--rate`` after a warm-up, each stage's batch time and
    lag, and the floor a plain consumer sees."""
    # events encoded ahead of time and stamped as they are sent (see freshrec.sim.produce)
    steady = prepare_events(world, int(args.rate * args.duration), seed=4)
    with bench_connection(f"br{int(time.time())}.") as conn:
        floor = raw_lag(conn, steady, args.rate)
        progress.done(
            f"raw Kafka lag (plain consumer): p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms"
        )

    with bench_connection(f"bl{int(time.time())}.") as conn:
        port = free_port()
        with service_process(conn, "streams", port) as proc:
            # warm up: the group join takes seconds on the embedded broker; measure after it
            # through the producer of the measured phase (see events_producer)
            producer = events_producer(conn)
            produce_prepared(conn, warm, rate_per_s=200, producer=producer)
            wait_for(port, proc, COUNTED, 150, 60, progress)
            time.sleep(1.0)
            name = "freshrec_hot_list_lag_seconds"
            before = scrape(f"http://127.0.0.1:{port}/metrics")
            stats = produce_prepared(
                conn, steady, rate_per_s=args.rate, progress=progress, producer=producer
            )
            close_producer(producer, 10)  # before its broker stops
            time.sleep(2)
            after = scrape(f"http://127.0.0.1:{port}/metrics")
        delta = subtract(after, before, name + "_bucket")
        stage_ms = {
            stage: p50_p99(before, after, "freshrec_streams_batch_seconds", stage=stage)
            for stage in ("validate", "validate_commit", "count", "publish")
        }
        for stage in ("repartitioned", "counted"):
            stage_ms[f"event_to_{stage}"] = p50_p99(
                before, after, "freshrec_streams_stage_lag_seconds", stage=stage
            )
        return {
            "rate_events_per_s": args.rate,
            "duration_s": args.duration,
            "events": stats.delivered,
            "observations": total(delta, name + "_bucket", le="+Inf"),
            **p50_p99(before, after, name),
            "stage_seconds": stage_ms,
            "raw_kafka": floor,
            "note": "after warm-up; quantiles interpolated in Prometheus histogram buckets; "
            "raw_kafka: the same events read by a plain consumer on a fresh broker",
        }


if __name__ == "__main__":
    main()
