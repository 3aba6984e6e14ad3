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
import time
from collections.abc import Iterator
from pathlib import Path

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from freshrec.kafka import admin_config, consumer_config, producer_config
from freshrec.settings import ConnectionSettings
from freshrec.stack import EmbeddedStack, external_services
from freshrec.topics import ensure_topics


@contextlib.contextmanager
def bench_connection(prefix: str) -> Iterator[ConnectionSettings]:
    """External services when set, else a private embedded stack; topics provisioned."""
    if external_services():
        conn = ConnectionSettings.from_env(os.environ).with_prefix(prefix)
        ensure_topics(AdminClient(admin_config(conn)), prefix)
        yield conn
        return
    with tempfile.TemporaryDirectory(prefix="freshrec-bench-") as tmp:
        stack = EmbeddedStack(Path(tmp))
        state = stack.up(detach=False)
        try:
            conn = ConnectionSettings(
                state.env["KAFKA_BOOTSTRAP_SERVERS"], state.env["REDIS_URL"], prefix
            )
            ensure_topics(AdminClient(admin_config(conn)), prefix)
            yield conn
        finally:
            stack.down()


@contextlib.contextmanager
def service_process(conn: ConnectionSettings, command: str, port: int, extra=None):
    """``freshrec <command>`` against ``conn`` with metrics on ``port``; stopped on exit."""
    env = dict(os.environ)
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=conn.kafka_bootstrap_servers, REDIS_URL=conn.redis_url,
        FRESHREC_TOPIC_PREFIX=conn.topic_prefix, FRESHREC_METRICS_PORT=str(port),
        **(extra or {}),
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "freshrec.cli", command], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
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
    from schemas.codec import encode_event
    from tools.traffic import EventSynthesizer

    synth = EventSynthesizer(world, seed=seed)
    now = int(time.time() * 1000)
    records: list[tuple[bytes, bytes]] = []
    while len(records) < n:
        records += [(e.user_id.encode(), encode_event(e)) for e in synth.batch(500, now)]
    return records[:n]


def produce_values(
    conn: ConnectionSettings, topic: str, records: list[tuple[bytes, bytes]]
) -> None:
    p = Producer(producer_config(conn, **{"linger.ms": 20}))
    for key, value in records:
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.05)
    if p.flush(60):
        raise RuntimeError("benchmark input not delivered")


def raw_consume_rate(conn: ConnectionSettings, topic: str, expected: int) -> float:
    """Messages/s of a confluent-kafka batch consumer reading ``expected`` messages."""
    c = Consumer(consumer_config(conn, f"{conn.topic_prefix}raw-{time.time_ns()}"))
    c.subscribe([topic])
    n, first = 0, None
    deadline = time.monotonic() + 120
    while n < expected and time.monotonic() < deadline:
        msgs = c.consume(10_000, 0.1)
        if msgs and first is None:
            first = time.perf_counter()
        n += sum(1 for m in msgs if not m.error())
    elapsed = time.perf_counter() - (first or time.perf_counter())
    c.close()
    if n < expected:
        raise RuntimeError(f"raw consumer read {n} of {expected}")
    return n / elapsed


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
