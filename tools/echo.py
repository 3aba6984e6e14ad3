"""A raw Kafka echo service with the worker's client settings: the floor that serving
latency is compared against in ``tools/bench_serving.py``.

    python -m tools.echo   (KAFKA_BOOTSTRAP_SERVERS, FRESHREC_TOPIC_PREFIX from the environment)

It reads ``recommend.requests`` in the workers' kind of group (range assignor, same fetch
wait) and answers each with an empty, schema-valid reply on its ``reply-to`` topic with the
same ``correlation-id`` — the same hops as a worker, none of the work.
"""

from __future__ import annotations

import json
import os
import signal
import threading

from confluent_kafka import Consumer, Producer

from freshcore import clock
from freshcore.kafka import consume_available, consumer_config, producer_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames


def main() -> None:
    conn = ConnectionSettings.from_env(os.environ)
    names = TopicNames(conn.topic_prefix)
    consumer = Consumer(consumer_config(conn, f"{conn.topic_prefix}freshrec-echo"))
    producer = Producer(producer_config(conn))
    consumer.subscribe([names.recommend_requests])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        for msg in consume_available(consumer, 500, 0.005):  # as the worker reads
            if msg.error():
                continue
            headers = dict(msg.headers() or [])
            req = json.loads(msg.value())
            reply = {
                "schema_version": 1,
                "request_id": req["request_id"],
                "user_id": req["user_id"],
                "items": [],
                "tier": "hot",
                "tier_reason": "echo",
                "served_at_ms": clock.now_ms(),
            }
            producer.produce(
                headers.get("reply-to", names.recommend_replies.encode()).decode(),
                json.dumps(reply).encode(),
                headers=[("correlation-id", headers.get("correlation-id", b""))],
            )
        producer.poll(0)
    producer.flush(5)
    consumer.close()


if __name__ == "__main__":
    main()
