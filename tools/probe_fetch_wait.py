"""Probe: how long a reader behind the tail waits for its first record, by fetch wait.

On the embedded broker a fetch costs CPU in proportion to the record batches a partition
holds, and an answer is due when ``fetch.wait.max.ms`` runs out. This probe fills one
partition with ``--batches`` records of one record each (one batch each, as a producer with
``linger.ms`` 0 at a low rate writes them), then for each fetch wait and each start position
(a share of the partition) assigns a fresh consumer there and times its first record, giving
up after ``--limit`` seconds. A reader that never gets one is a consumer that, once behind,
does not catch up.

    .venv/bin/python -m tools.probe_fetch_wait [--batches 150000] [--waits 10,20,100,500]

Writes artifacts/probe_fetch_wait.json (``--out``). Runs on its own embedded stack (or on
``KAFKA_BOOTSTRAP_SERVERS`` when set). Needs nothing running.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from freshcore.kafka import admin_config, consumer_config, producer_config
from freshrec.progress import ProgressLine
from tools.benchlib import bench_connection, save


def fill(conn, topic: str, batches: int) -> float:
    """``batches`` one-record batches on partition 0 of ``topic``; records/s produced."""
    p = Producer(producer_config(conn, **{"linger.ms": 0, "batch.num.messages": 1}))
    progress = ProgressLine()
    started = time.perf_counter()
    for i in range(batches):
        p.produce(topic, b"x" * 200, partition=0)
        if i % 100 == 99:  # a few in flight at a time: each its own batch
            p.flush(30)
            progress.update(f"  {i + 1:,} of {batches:,} batches produced")
    if p.flush(60):
        raise RuntimeError("probe input not delivered")
    rate = batches / (time.perf_counter() - started)
    progress.done(f"  {batches:,} batches produced, {rate:,.0f}/s")
    return rate


def first_record_s(conn, topic: str, offset: int, wait_ms: int, limit_s: float) -> float | None:
    """Seconds from assignment at ``offset`` to the first record, None after ``limit_s``."""
    c = Consumer(consumer_config(conn, None, **{"fetch.wait.max.ms": wait_ms}))
    c.assign([TopicPartition(topic, 0, offset)])
    started = time.monotonic()
    try:
        while time.monotonic() - started < limit_s:
            msg = c.poll(0.2)
            if msg is not None and msg.error() is None:
                return round(time.monotonic() - started, 3)
        return None
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=150_000, help="one-record batches held")
    ap.add_argument("--waits", default="10,20,100,500", help="fetch.wait.max.ms values")
    ap.add_argument("--at", default="0,0.5,0.99", help="start positions, shares of the partition")
    ap.add_argument("--limit", type=float, default=8.0, help="seconds to wait for a record")
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    prefix = f"probe{uuid.uuid4().hex[:6]}."
    with bench_connection(prefix) as conn:
        topic = f"{prefix}fetch-wait"
        admin = AdminClient(admin_config(conn))
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
        rate = fill(conn, topic, args.batches)
        rows = []
        for share in (float(s) for s in args.at.split(",")):
            offset = int(args.batches * share)
            for wait_ms in (int(w) for w in args.waits.split(",")):
                got = first_record_s(conn, topic, offset, wait_ms, args.limit)
                rows.append({"offset": offset, "fetch_wait_ms": wait_ms, "first_record_s": got})
                print(
                    f"  from offset {offset:,}, fetch wait {wait_ms} ms: "
                    + (
                        f"first record after {got} s"
                        if got is not None
                        else f"nothing in {args.limit} s"
                    ),
                    flush=True,
                )
    save(
        "probe_fetch_wait",
        {
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "produced_per_s": round(rate),
            "reads": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
