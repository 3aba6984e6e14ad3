"""Every Prometheus metric FreshRec exports, defined once. Services import what they use.

Names follow Prometheus conventions: ``freshrec_`` namespace, base units in names,
``_total`` for counters.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# ------------------------------------------------------------------------------ streams
STREAMS_EVENTS = Counter(
    "freshrec_streams_events_total", "Events read by the streams app, by outcome", ["outcome"]
)
DEAD_LETTERS = Counter(
    "freshrec_dead_letters_total", "Records sent to a dead-letter topic, by reason", ["reason"]
)
STREAMS_LATE = Counter("freshrec_streams_late_events_total", "Events older than the grace period")
STREAMS_REPLAYED = Counter(
    "freshrec_streams_replayed_events_total", "Repartitioned events skipped as already counted"
)
HOT_LIST_LAG = Histogram(
    "freshrec_hot_list_lag_seconds",
    "Event time to the hot list that includes the event being published",
    buckets=LAG_BUCKETS_S,
)
HOT_LIST_PUBLISHES = Counter("freshrec_hot_list_publishes_total", "Hot lists published", ["scope"])
STREAMS_PARTITIONS = Gauge(
    "freshrec_streams_item_partitions", "events.by_item partitions owned by this instance"
)


def serve_metrics(port: int) -> None:
    """Expose /metrics on ``port`` (0: do nothing)."""
    if port:
        start_http_server(port, addr="0.0.0.0")
        log.info("metrics on :%d/metrics", port)
