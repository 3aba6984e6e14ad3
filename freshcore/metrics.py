"""Every Prometheus metric FreshRec exports, defined once. Services import what they use.

Names follow Prometheus conventions: ``freshrec_`` namespace, base units in names,
``_total`` for counters.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily

log = logging.getLogger(__name__)


def observe_many(histogram, values) -> None:
    """``histogram.observe(v)`` for every value, in one pass: the values are binned with
    numpy and each bucket and the sum are incremented once (a labelled child or an
    unlabelled histogram; prometheus_client keeps per-bucket counts internally).

    >>> h = Histogram("doc_observe_many_seconds", "doc", buckets=(0.1, 1.0), registry=None)
    >>> observe_many(h, [0.05, 0.1, 0.5, 7.0])
    >>> [b.get() for b in h._buckets], h._sum.get()
    ([2.0, 1.0, 1.0], 7.65)
    """
    values = np.asarray(values, np.float64)
    if not len(values):
        return
    bounds = np.asarray(histogram._upper_bounds, np.float64)
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    for bucket, count in zip(histogram._buckets, counts.tolist(), strict=False):
        if count:
            bucket.inc(count)
    histogram._sum.inc(float(values.sum()))


LAG_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1, 1.5, 2, 3, 5, 10, 30, 60,
)  # fmt: skip


# ---------------------------------------------------------------------------------- cost
class _CpuCollector:
    """``freshrec_cpu_seconds_total``: the CPU (user + system) this process has used. A
    service's child process (the streams app's validate stage) exports its own, which the
    parent's endpoint adds in (``freshcore.childmetrics``): one figure per service, what the
    cost rules price (``tools/prometheus_rules.py``)."""

    def collect(self):
        family = CounterMetricFamily(
            "freshrec_cpu_seconds",
            "CPU seconds this service's processes have used (user + system)",
        )
        family.add_metric([], time.process_time())
        yield family


COLLECTORS = (_CpuCollector(),)
"""This module's custom collectors (registered once, at import)."""
for _collector in COLLECTORS:
    REGISTRY.register(_collector)

# -------------------------------------------------------------------------------- redis
REDIS_UNAVAILABLE = Counter(
    "freshrec_redis_unavailable_total",
    "Redis calls that failed for a reason that passes and will be made again, by reason: "
    "down (no answer) or the refusal (oom at maxmemory, clusterdown, tryagain, loading, …)",
    ["reason"],
)
REDIS_WAITING = Gauge(
    "freshrec_redis_waiting",
    "Operations of this process waiting for Redis to answer or take them (0: none)",
)

# ------------------------------------------------------------------------------ streams
STREAMS_EVENTS = Counter(
    "freshrec_streams_events_total", "Events read by the streams app, by outcome", ["outcome"]
)
DEAD_LETTERS = Counter(
    "freshrec_dead_letters_total", "Records sent to a dead-letter topic, by reason", ["reason"]
)
PRODUCE_RETRIES = Counter(
    "freshrec_produce_retries_total",
    "Messages produced again after a delivery failed for a reason that may pass, by what "
    "they carry (reply, dead letter, gradients)",
    ["what"],
)
STREAMS_COUNTED = Counter(
    "freshrec_streams_counted_events_total", "Events counted into item state (after repartition)"
)
STREAMS_COVISIT_PAIRS = Counter(
    "freshrec_streams_covisit_pairs_total",
    "Co-visitation pairs counted (each way of a pair once; replays and late ones not)",
)
STREAMS_SEQUEL_PAIRS = Counter(
    "freshrec_streams_sequel_pairs_total",
    "Sequential-rule pairs a -> b counted (replays and late ones not)",
)
STREAMS_BATCH_SIZE = Histogram(
    "freshrec_streams_batch_messages",
    "Messages per agent batch",
    ["stage"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)
CATALOGUE_RECORDS = Counter(
    "freshrec_streams_catalogue_records_total", "Item records written to the catalogue in Redis"
)
CATALOGUE_DELETES = Counter(
    "freshrec_streams_catalogue_deletes_total",
    "Items removed from the catalogue in Redis by a tombstone on the items topic",
)
STREAMS_BATCH_SECONDS = Histogram(
    "freshrec_streams_batch_seconds",
    "Time to process one agent batch",
    ["stage"],
    buckets=LAG_BUCKETS_S,
)
STREAMS_LATE = Counter("freshrec_streams_late_events_total", "Events older than the grace period")
STREAMS_LATENESS_FLOOR = Gauge(
    "freshrec_streams_lateness_floor_timestamp_seconds",
    "Event time below which the count stage drops events as late, the least over this "
    "instance's events.by_item partitions: the least watermark of the events partitions "
    "holding it, minus FRESHREC_LATE_GRACE_MS (0: one that has delivered nothing holds it)",
)
STREAMS_REPLAYED = Counter(
    "freshrec_streams_replayed_events_total", "Repartitioned events skipped as already counted"
)
HOT_LIST_LAG = Histogram(
    "freshrec_hot_list_lag_seconds",
    "Event time to the hot list that includes the event being published",
    buckets=LAG_BUCKETS_S,
)
STREAMS_STAGE_LAG = Histogram(
    "freshrec_streams_stage_lag_seconds",
    "Event time to a point in the streams app: repartitioned (the events.by_item record's "
    "timestamp), counted (persisted), covisit (an anchor's neighbour list written, timed "
    "from its newest pair) or sequel (its successor list, from its newest rule); the "
    "hot-list lag adds publishing",
    ["stage"],
    buckets=LAG_BUCKETS_S,
)
HOT_LIST_PUBLISHES = Counter("freshrec_hot_list_publishes_total", "Hot lists published", ["scope"])
STREAMS_ITEMS = Gauge(
    "freshrec_streams_items", "Items whose counts this instance holds (all its partitions)"
)
STREAMS_COVISIT_NEIGHBOURS = Gauge(
    "freshrec_streams_covisit_neighbours",
    "Co-visitation neighbours this instance counts (all its anchors and partitions; at most "
    "its items × FRESHREC_COVISIT_CANDIDATES, and FRESHREC_COVISIT_MAX_NEIGHBOURS a partition)",
)
STREAMS_COVISIT_TRIMMED = Counter(
    "freshrec_streams_covisit_trimmed_total",
    "Co-visitation neighbours cut from the longest rows of a partition past "
    "FRESHREC_COVISIT_MAX_NEIGHBOURS",
)
STREAMS_SEQUEL_SUCCESSORS = Gauge(
    "freshrec_streams_sequel_successors",
    "Sequential-rule successors this instance counts (all its anchors and partitions; at "
    "most its items × FRESHREC_SEQUEL_CANDIDATES, and FRESHREC_SEQUEL_MAX_SUCCESSORS a "
    "partition)",
)
STREAMS_SEQUEL_TRIMMED = Counter(
    "freshrec_streams_sequel_trimmed_total",
    "Sequential-rule successors cut from the longest rows of a partition past "
    "FRESHREC_SEQUEL_MAX_SUCCESSORS",
)
STREAMS_EVICTED = Counter(
    "freshrec_streams_items_evicted_total",
    "Items whose counts left the streams state: idle (decayed below "
    "FRESHREC_STREAMS_EVICT_BELOW) or cap (past FRESHREC_STREAMS_MAX_ITEMS per partition)",
    ["reason"],
)
STREAMS_REWRITES = Counter(
    "freshrec_streams_state_rewrites_total",
    "Partitions whose whole counting state was written again: Redis had lost a snapshot it "
    "acknowledged (its offsets read back behind the last one written: a failover)",
)
STREAMS_PARTITIONS = Gauge(
    "freshrec_streams_item_partitions", "events.by_item partitions owned by this instance"
)


# --------------------------------------------------------------------- online learning
FRESHNESS_LAG = Histogram(
    "freshrec_freshness_lag_seconds",
    "Event time to the moment its effect is usable, per stage: local (learnt by this worker), "
    "global_applied (persisted by this parameter server), served (in a broadcast row this "
    "worker installed), reply (in a row a reply used first); each row timed from the oldest "
    "event it includes",
    ["stage"],
    buckets=LAG_BUCKETS_S,
)
FRESHNESS_EVENT_TIME = Gauge(
    "freshrec_freshness_event_timestamp_seconds",
    "The newest event time (seconds since the epoch) that has reached each stage: local "
    "(learnt by this worker), global_applied (persisted by this parameter server), served "
    "(in a broadcast row this worker installed), reply (in a row a reply used). local minus served is how far the global "
    "path is behind, and keeps growing while it is down, when the lag histograms only stop",
    ["stage"],
)
WORKER_EVENTS = Counter("freshrec_worker_events_total", "Events read by the worker", ["outcome"])
WORKER_LOOP_SECONDS = Histogram(
    "freshrec_worker_loop_seconds",
    "Time of each phase of one worker loop round (consume, serve, learn, updates, other)",
    ["phase"],
    buckets=LAG_BUCKETS_S,
)
WORKER_FETCH_LAG = Histogram(
    "freshrec_worker_fetch_lag_seconds",
    "Kafka timestamp of an event message (its producer's clock) to the worker's consume "
    "returning it: the broker's and the fetch's share of the local freshness lag",
    buckets=LAG_BUCKETS_S,
)
WORKER_EVENT_PAUSES = Counter(
    "freshrec_worker_event_pauses_total",
    "Times the worker paused its event partitions: its own backlog past the high mark "
    "(backlog), or its consumes full (events waiting in the client's queue), to drop the "
    "prefetched ones so requests behind them are fetched (prefetch)",
    ["reason"],
)
WORKER_EXAMPLES = Counter("freshrec_worker_examples_total", "Training examples", ["label"])
GRADIENT_ROWS = Counter(
    "freshrec_gradient_rows_total", "Gradient rows by fate", ["table", "outcome"]
)
GRADIENT_MESSAGES = Counter("freshrec_gradient_messages_total", "Gradient messages", ["side"])
UPDATES_INSTALLED = Counter(
    "freshrec_updates_installed_total", "Broadcast rows by fate in the worker", ["table", "outcome"]
)
CACHE_LOOKUPS = Counter(
    "freshrec_cache_lookups_total",
    "Embedding rows looked up, by the tier that had them",
    ["table", "tier"],
)
CACHE_ROWS = Gauge("freshrec_cache_rows", "Rows resident on the device", ["table"])
HOST_ROWS = Gauge(
    "freshrec_cache_host_rows",
    "Rows held in host RAM, the cache's second level (FRESHREC_HOST_USER_ROWS, "
    "FRESHREC_HOST_ITEM_ROWS): rows the device let go",
    ["table"],
)
CACHE_ROWS_EXPIRED = Counter(
    "freshrec_cache_rows_expired_total",
    "Rows a worker dropped after the row TTL without a touch (items outside the catalogue)",
    ["table"],
)
RANKING_OOM = Counter(
    "freshrec_ranking_oom_total",
    "Ranking batches the device had no memory for (split in halves and scored again; a single "
    "request that still does not fit is served from the hot tier), by model",
    ["model"],
)
DEVICE_OOM = Counter(
    "freshrec_device_oom_total",
    "Out-of-memory errors the device raised and the worker survived, by path: ranking (the "
    "batch split in halves), learning (the slice split in halves, a part that still does not "
    "fit stepped on the host), rerank (the batch re-ranked on the host), table (the item table "
    "not grown: bounded at its size, the least recently touched rows outside the catalogue to "
    "host RAM)",
    ["path"],
)
CACHE_ROWS_EVICTED = Counter(
    "freshrec_cache_rows_evicted_total",
    "Rows a worker dropped because its table was at its bound (FRESHREC_MAX_ITEM_ROWS), the "
    "least recently touched first (items outside the catalogue)",
    ["table"],
)
PENDING_STEPS = Gauge("freshrec_pending_local_steps", "Local steps not yet in a global row")
PENDING_STEPS_LET_GO = Counter(
    "freshrec_pending_local_steps_let_go_total",
    "Local steps whose read-your-writes bookkeeping was let go: the pool was at its bound "
    "(FRESHREC_MAX_PENDING_STEPS), the parameter server down or far behind",
)
PS_ROWS_APPLIED = Counter("freshrec_ps_rows_applied_total", "Rows updated by Adagrad", ["table"])
PS_ROWS_EVICTED = Counter(
    "freshrec_ps_rows_evicted_total",
    "Rows not updated for the row TTL, dropped from memory",
    ["table"],
)
PS_REWRITES = Counter(
    "freshrec_ps_partition_rewrites_total",
    "gradients partitions whose rows were written again: Redis had lost a transaction it "
    "acknowledged (their applied offset read back behind the last one written: a failover)",
)
PS_FLUSHES = Counter("freshrec_ps_flushes_total", "Persist+broadcast rounds", ["outcome"])
PS_FLUSH_SECONDS = Histogram(
    "freshrec_ps_flush_seconds", "Time to persist and broadcast one flush", buckets=LAG_BUCKETS_S
)
PS_SKIPPED = Counter("freshrec_ps_skipped_messages_total", "Gradient messages skipped", ["reason"])
PS_BROADCASTS = Counter(
    "freshrec_ps_broadcast_messages_total",
    "Update messages on embeddings.updates, by delivery outcome (delivered, failed)",
    ["outcome"],
)


# ------------------------------------------------------------------------------ serving
REQUESTS = Counter(
    "freshrec_requests_total",
    "Recommendation requests read by the worker, by outcome "
    "(served, expired, duplicate, invalid, revoked)",
    ["outcome"],
)
REPLIES = Counter("freshrec_replies_total", "Replies sent, by tier and mode", ["tier", "mode"])
SERVING_COST = Counter(
    "freshrec_serving_cost_seconds_total",
    "Serving work by mode: each request's share of its batch's recall, ranking and "
    "re-ranking time (a reply's timings_ms.cost), summed",
    ["mode"],
)
REPLY_ITEMS = Counter(
    "freshrec_reply_items_total",
    "Items listed in replies, by whether the item is new (created within "
    "FRESHREC_NEW_ITEM_WINDOW_MS): the cost formula's share of new items",
    ["new"],
)
MODE_INFO = Gauge(
    "freshrec_mode_info", "The serving mode this worker serves in (1 for the current one)", ["mode"]
)
MODE_RECORDS = Counter(
    "freshrec_mode_records_total",
    "Control records read, by outcome: adopted (the mode switched), same (already in it), "
    "older (written before the one adopted), "
    "unknown_mode (not a mode this worker knows: kept its mode), invalid (not a control record)",
    ["outcome"],
)
FEEDBACK = Counter(
    "freshrec_feedback_events_total",
    "Impressions, clicks and conversions naming a reply, by the tier that served it (unknown: "
    "served by another worker or too long ago): CTR = clicks / impressions",
    ["event_type", "tier"],
)
REQUEST_SECONDS = Histogram(
    "freshrec_request_seconds",
    "Request latency per stage (topic: record timestamp to read; queue: read to batch start; "
    "recall, rank, rerank; total: from the record timestamp), tier and serving mode",
    ["stage", "tier", "mode"],
    buckets=LAG_BUCKETS_S,
)
REQUEST_BATCH_SIZE = Histogram(
    "freshrec_request_batch_size",
    "Requests per dynamic batch",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
RANKING_SECONDS = Histogram(
    "freshrec_ranking_batch_seconds",
    "One ranking model's forward pass over a batch's candidates, by model "
    "(wide_deep, light, pruned, attention, attention_window, attention_lowrank)",
    ["ranker"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)
RANKED_CANDIDATES = Counter(
    "freshrec_ranked_candidates_total",
    "Candidates scored, by the model that scored them (a tiered request's by each tier's)",
    ["ranker"],
)
DEGRADED = Counter(
    "freshrec_degraded_replies_total",
    "Replies below the full tier or degraded, by reason",
    ["tier", "reason"],
)
RECALL_CALLS = Counter(
    "freshrec_recall_calls_total",
    "Recall channel calls per batch, by outcome (ok, timeout, error, breaker_open)",
    ["channel", "outcome"],
)
BREAKER_STATE = Gauge(
    "freshrec_breaker_state", "Recall channel breaker: 0 closed, 1 half-open, 2 open", ["channel"]
)
MODEL_INFO = Gauge("freshrec_model_info", "The ranking model version in use (value 1)", ["version"])
EXPERIMENT_REQUESTS = Counter(
    "freshrec_experiment_requests_total",
    "Requests served per A/B experiment variant",
    ["experiment", "variant"],
)
EXPERIMENT_EVENTS = Counter(
    "freshrec_experiment_events_total",
    "Impressions, clicks and conversions naming a reply, per experiment variant (streams app); "
    "variant 'unattributed' when the reply's variant is not known (no experiment, or expired)",
    ["experiment", "variant", "event_type"],
)
DEVICE_MEMORY = Gauge(
    "freshrec_device_memory_bytes",
    "A GPU worker's device memory (the CUDA caching allocator's): allocated, reserved, "
    "inactive_split (reserved, split, unused: fragmentation) and total; absent on a CPU",
    ["kind"],
)
DEVICE_INFO = Gauge(
    "freshrec_device_info", "The device the worker's tables live on (value 1)", ["device"]
)
MODEL_RELOADS = Counter("freshrec_model_reloads_total", "Model loads", ["outcome"])
CATALOGUE_ITEMS = Gauge("freshrec_catalogue_items", "Items in the worker's catalogue snapshot")
COLD_ITEMS_STARTED = Counter(
    "freshrec_cold_items_started_total",
    "Catalogue items without a learnt row started from their category's mean row",
)
ANN_INDEX_ITEMS = Gauge(
    "freshrec_ann_index_items", "Items in the vector channel's IVF index (0: exact search)"
)
ANN_BUILD_SECONDS = Gauge("freshrec_ann_build_seconds", "Time the last IVF index build took")
ANN_BUILT_AT = Gauge(
    "freshrec_ann_built_timestamp_seconds", "When the IVF index in use was built (Unix time)"
)
SNAPSHOT_REFRESHES = Counter(
    "freshrec_snapshot_refreshes_total", "Snapshot refreshes from Redis", ["outcome"]
)
EVENT_BACKLOG = Gauge(
    "freshrec_worker_event_backlog", "Events read but not yet learnt (requests go first)"
)
CONSUMER_LAG = Gauge(
    "freshrec_consumer_lag_messages",
    "Messages behind the partition end, from the consumer's own fetch responses "
    "(librdkafka statistics)",
    ["group", "topic", "partition"],
)


CONSUMER_SKIPPED = Counter(
    "freshrec_consumer_skipped_messages_total",
    "Messages a consumer never read: the offset it resumed from was below the partition's log "
    "start offset (deleted by retention) and it resumed at the log start (freshcore/resets.py)",
    ["group", "topic"],
)
ASSIGNED_PARTITIONS = Gauge(
    "freshrec_assigned_partitions", "Input partitions this process owns in its group", ["service"]
)
