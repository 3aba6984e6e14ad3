"""Run ``freshrec streams`` instances as real processes and compute expectations by brute force."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from confluent_kafka import Producer

from freshcore import clock
from freshcore.hotscore import HotWeights, Smoothing, price_norm
from freshcore.kafka import producer_config
from freshcore.topics import TopicNames
from schemas.codec import encode_event, encode_item
from schemas.records import Event, Item

HOUR_MS = 3_600_000


def service_env(conn, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRESHREC_")}
    env.update(
        KAFKA_BOOTSTRAP_SERVERS=conn.kafka_bootstrap_servers,
        REDIS_URL=conn.redis_url,
        FRESHREC_TOPIC_PREFIX=conn.topic_prefix,
        FRESHREC_KAFKA_PROFILE=conn.kafka_profile,
        PYTHONUNBUFFERED="1",
    )
    if conn.kafka_session_timeout_ms is not None:
        env["FRESHREC_KAFKA_SESSION_TIMEOUT_MS"] = str(conn.kafka_session_timeout_ms)
    env.update(extra)
    return env


@contextlib.contextmanager
def service(conn, command: str, log_path: Path, **extra: str) -> Iterator[subprocess.Popen]:
    """A ``freshrec <command>`` process; stopped (SIGTERM, then SIGKILL) on exit."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "freshrec.app.cli", *command.split()],
            env=service_env(conn, **extra),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class HeldProducer:
    """A worker's producer whose messages to the topics ``hold`` picks sit in it, handed
    over but never delivered, until ``release`` (the broker takes them), ``fail`` (librdkafka
    gives up on them) or ``purge``; the rest go through to ``real``."""

    def __init__(self, real, hold: Callable[[str], bool]) -> None:
        self.real, self.hold = real, hold
        self.held: list[tuple[str, dict]] = []

    def produce(self, topic, **kw) -> None:
        if self.hold(topic):
            self.held.append((topic, kw))
        else:
            self.real.produce(topic, **kw)

    def release(self) -> None:
        """The broker takes what was held."""
        for topic, kw in self.held:
            self.real.produce(topic, **kw)
        self.held.clear()
        assert self.real.flush(10) == 0

    def fail(self, code: int | None = None) -> int:
        """Report every held message undelivered (``_MSG_TIMED_OUT``: what librdkafka says
        once ``message.timeout.ms`` has passed); how many."""
        from confluent_kafka import KafkaError

        held, self.held = self.held, []
        for _, kw in held:
            if kw.get("on_delivery"):
                kw["on_delivery"](KafkaError(code or KafkaError._MSG_TIMED_OUT), None)
        return len(held)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """librdkafka's purge of what it has not sent: held messages fail with _PURGE_QUEUE
        (at the next poll, like librdkafka's reports)."""

        self._purged, self.held = [kw for _, kw in self.held], []
        self.real.purge(in_queue=in_queue, in_flight=in_flight, blocking=blocking)

    def poll(self, timeout: float = 0) -> int:
        from confluent_kafka import KafkaError

        for kw in getattr(self, "_purged", []):
            if kw.get("on_delivery"):
                kw["on_delivery"](KafkaError(KafkaError._PURGE_QUEUE), None)
        self._purged = []
        return self.real.poll(timeout)

    def flush(self, timeout: float = -1) -> int:
        """The held messages count as undelivered, as librdkafka's flush counts them."""
        self.poll(0)
        return self.real.flush(timeout) + len(self.held)

    def __len__(self) -> int:
        return len(self.real) + len(self.held)

    def __getattr__(self, name):
        return getattr(self.real, name)


def dead_letters(conn, topic: str, n: int, timeout_s: float = 30.0) -> list:
    """The first ``n`` dead letters on ``topic`` (fewer if ``timeout_s`` passes first), read
    by a new consumer group from the beginning."""
    from confluent_kafka import Consumer

    from freshcore.kafka import consumer_config
    from schemas.codec import decode_dead_letter

    consumer = Consumer(consumer_config(conn, f"{conn.topic_prefix}dlq-reader-{time.time_ns()}"))
    consumer.subscribe([topic])
    letters = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(letters) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                letters.append(decode_dead_letter(msg.value(), clock.now_ms()))
    finally:
        consumer.close()
    return letters


def produce(conn, events: list[Event] | None = None, items: list[Item] | None = None, raw=()):
    names = TopicNames(conn.topic_prefix)
    p = Producer(producer_config(conn))
    for item in items or []:
        p.produce(names.items, key=item.item_id.encode(), value=encode_item(item))
    for e in events or []:
        p.produce(names.events, key=e.user_id.encode(), value=encode_event(e))
    for key, value in raw:
        p.produce(names.events, key=key, value=value)
    assert p.flush(15) == 0


def brute_force(events: list[Event], prices: dict[str, float], at_ms: int, rate=0.95):
    """Decayed counts per (scope, item) and the hot score, from first principles."""
    counts: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    seen: set[str] = set()
    kinds = {"impression": 0, "click": 1, "conversion": 2}
    for e in events:
        if e.event_id in seen:
            continue
        seen.add(e.event_id)
        w = rate ** ((at_ms - e.ts_ms) / HOUR_MS)
        counts[("global", e.item_id)][kinds[e.event_type]] += w
        if e.region:
            counts[(e.region, e.item_id)][kinds[e.event_type]] += w
    sm, wt = Smoothing(), HotWeights()
    out: dict[str, dict[str, tuple[float, ...]]] = defaultdict(dict)
    for (scope, item), (imp, clk, conv) in counts.items():
        ctr = (clk + sm.ctr_strength * sm.ctr_prior) / (imp + sm.ctr_strength)
        cvr = (conv + sm.cvr_strength * sm.cvr_prior) / (clk + sm.cvr_strength)
        hot = wt.click * clk + wt.cvr * cvr + wt.price * float(price_norm(prices.get(item, 0.0)))
        out[scope][item] = (imp, clk, conv, ctr, cvr, hot)
    return out


def top_k(scores: dict[str, tuple[float, ...]], k: int) -> list[str]:
    return [i for i, _ in sorted(scores.items(), key=lambda x: (-x[1][5], x[0]))[:k]]


def wait_for(condition, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last is True:
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {last}")


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


@contextlib.contextmanager
def private_redis(conn) -> Iterator[tuple]:
    """A Redis server of the test's own (to freeze with SIGSTOP): (connection settings that
    use it, its process). Always resumed and stopped on exit."""
    import tempfile

    import redis as redis_lib

    from freshrec.app.stack import free_port, redis_argv, redis_binary

    port = free_port()
    proc = subprocess.Popen(
        redis_argv(redis_binary(), port, Path(tempfile.gettempdir())),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def pings() -> bool:
        try:
            return bool(redis_lib.Redis.from_url(url, socket_timeout=1).ping())
        except redis_lib.RedisError:
            return False

    try:
        wait_for(pings, 20, "private redis")
        yield conn.__class__(conn.kafka_bootstrap_servers, url, conn.topic_prefix), proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


def item_feature(r, keys, name: str, item: str):
    """The serving feature ``name`` of ``item`` as Redis holds it (None: not written yet),
    from the hash of the item's ``events.by_item`` partition."""
    from freshcore.partitioner import str_partitions

    shards = int(r.get(keys.feature_shards) or 0)
    if not shards:
        return None
    return r.hget(keys.item_feature(name, int(str_partitions([item], shards)[0])), item)


def all_features(r, keys, name: str) -> dict:
    """Every item's serving feature ``name`` (``keys.item_features_as_of`` for ``as_of``)."""
    shards = int(r.get(keys.feature_shards) or 0)
    out = {}
    for s in range(shards):
        key = keys.item_features_as_of(s) if name == "as_of" else keys.item_feature(name, s)
        out.update(r.hgetall(key))
    return out


def brute_force_covisit(
    events: list[Event],
    window: int | None = None,
    window_ms: int | None = None,
    max_pairs: int | None = None,
    rate: float = 0.95,
) -> dict[str, dict[str, float]]:
    """Each anchor's neighbours and P(b | a), from first principles: per user in the order
    produced, a click on b pairs with the user's last ``window`` distinct clicked items a
    clicked strictly earlier and within ``window_ms`` (``max_pairs`` newest), both ways;
    c(a, b) and a's clicks decayed alike, so their ratio needs no time."""
    from streams.covisit import CoVisitConfig

    default = CoVisitConfig()  # the streams app's defaults
    window = default.window if window is None else window
    window_ms = default.window_ms if window_ms is None else window_ms
    max_pairs = default.max_pairs if max_pairs is None else max_pairs
    seen: set[str] = set()
    last = max((e.ts_ms for e in events), default=0)
    windows: dict[str, list[tuple[str, int]]] = defaultdict(list)
    pairs: dict[tuple[str, str], float] = defaultdict(float)
    clicks: dict[str, float] = defaultdict(float)
    for e in events:
        if e.event_id in seen:
            continue
        seen.add(e.event_id)
        if e.event_type != "click":
            continue
        w = rate ** ((last - e.ts_ms) / HOUR_MS)  # decayed to a common time: any one will do
        clicks[e.item_id] += w
        mine = windows[e.user_id]
        near = [
            a for a, ta in mine if a != e.item_id and ta < e.ts_ms and e.ts_ms - ta <= window_ms
        ]
        for a in near[:max_pairs]:
            pairs[(a, e.item_id)] += w
            pairs[(e.item_id, a)] += w
        mine[:] = [(e.item_id, e.ts_ms), *((a, t) for a, t in mine if a != e.item_id)][:window]
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (a, b), c in pairs.items():
        out[a][b] = c / clicks[a]
    return out


def covisit_lists(conn) -> dict[str, dict[str, float]]:
    """Every anchor's published neighbour list, from every by-item partition's hash."""
    return published_lists(conn, lambda k, s: k.covisit(s))


def matches_covisit(conn, events: list[Event]) -> bool | str:
    return same_lists(covisit_lists(conn), brute_force_covisit(events))


def brute_force_sequel(
    events: list[Event], steps: int | None = None, rate: float = 0.95
) -> dict[str, dict[str, float]]:
    """Each anchor's successors and their shares, from first principles (Ludewig & Jannach's
    sequential rules): per user, their clicks in the order produced, a consecutive repeat of
    an item collapsed; a click on b that is not such a repeat follows each of the user's last
    ``steps`` items a before it at distance d (1: the one just before), and r(a → b) += 1/d
    (decayed by the click's time) unless a is b; a successor's share is r(a → b) over the
    sum of a's rules (decayed alike, so the ratio needs no time)."""
    from streams.covisit import CoVisitConfig

    steps = CoVisitConfig().sequel_steps if steps is None else steps
    seen: set[str] = set()
    last = max((e.ts_ms for e in events), default=0)
    sequences: dict[str, list[str]] = defaultdict(list)
    rules: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.event_id in seen or e.event_type != "click":
            continue
        seen.add(e.event_id)
        sequence = sequences[e.user_id]
        if sequence and sequence[-1] == e.item_id:
            continue
        w = rate ** ((last - e.ts_ms) / HOUR_MS)
        for d in range(1, min(steps, len(sequence)) + 1):
            a = sequence[-d]
            if a != e.item_id:
                rules[a][e.item_id] += w / d
        sequence.append(e.item_id)
    return {a: {b: r / sum(row.values()) for b, r in row.items()} for a, row in rules.items()}


def published_lists(conn, key_of) -> dict[str, dict[str, float]]:
    """Every anchor's published list, from every by-item partition's hash ``key_of(keys,
    shard)`` (``RedisKeys.covisit`` or ``RedisKeys.sequel``)."""
    from freshcore.neighbours import read_serving_list
    from freshcore.redisconn import connect
    from freshcore.rediskeys import RedisKeys

    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    out: dict[str, dict[str, float]] = {}
    try:
        for shard in range(int(r.get(keys.feature_shards) or 0)):
            for anchor, raw in r.hgetall(key_of(keys, shard)).items():
                out[anchor.decode()] = dict(read_serving_list(raw))
    finally:
        r.close()
    return out


def same_lists(got: dict, want: dict) -> bool | str:
    """True when the published lists ``got`` hold exactly ``want`` (anchor → item → score)."""
    if set(got) != set(want):
        return f"anchors: {len(got)} published, {len(want)} expected"
    for a, items in want.items():
        if set(got[a]) != set(items):
            return f"{a}: {sorted(got[a])} != {sorted(items)}"
        for b, p in items.items():
            if not math.isclose(got[a][b], p, rel_tol=1e-6):
                return f"{a}->{b}: {got[a][b]} != {p}"
    return True


def matches_sequel(conn, events: list[Event]) -> bool | str:
    """The successor lists in Redis are a brute-force pass's over ``events``."""
    return same_lists(published_lists(conn, lambda k, s: k.sequel(s)), brute_force_sequel(events))
