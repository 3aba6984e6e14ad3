"""Online learning against the real broker and Redis: local fine-tune, parameter server,
broadcast, read-your-writes, crash recovery, takeover, bounded rows, worker restart."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import redis as redis_lib
from confluent_kafka import Producer

from freshcore import clock
from freshcore.kafka import close_producer, partition_count, producer_config
from freshcore.partitioner import kafka_partition, row_partitions
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from inference.clients import WorkerClients
from inference.settings import LearningSettings, WorkerSettings
from inference.worker import Worker
from param_server.store import (
    HPEXPIRE,
    HSETEX,
    applied_offsets,
    claim_partitions,
    fetch_rows_and_accumulators,
    field_expiry,
    pack_persist,
    persist_fenced,
)
from schemas.ids import row_id
from schemas.records import Event
from schemas.rowbatch import KIND_GRADIENTS, RowBatch
from schemas.rows import (
    TABLE_ITEM,
    TABLE_USER,
    decode_row,
    initial_rows,
    row_key,
    updates_since_creation,
    version_floor,
)

from .conftest import TEST_PARTITIONS
from .streams_harness import HeldProducer, private_redis, produce, service, stop, wait_for

DIM = 8
W = DIM + 1
ENV = {"FRESHREC_EMBEDDING_DIM": str(DIM), "FRESHREC_FLUSH_INTERVAL_MS": "50"}


def learner(conn, held: bool = False, **learning) -> Worker:
    """A started worker; with ``held`` its gradient messages sit in a ``HeldProducer``
    (``w.producer``) until released."""
    s = WorkerSettings(conn, LearningSettings(dim=DIM, **learning), user_capacity_rows=1000)
    return started(s, held)


def started(s: WorkerSettings, held: bool = False) -> Worker:
    clients = WorkerClients.connect(s)
    if held:
        gradients = TopicNames(s.conn.topic_prefix).gradients
        clients.producer = HeldProducer(clients.producer, lambda topic: topic == gradients)
    w = Worker(s, clients)
    w.start()
    return w


def held_gradients(w: Worker) -> list[tuple[int, RowBatch, object]]:
    """The gradient messages held in ``w.producer``: (token, batch, delivery callback). The
    sender numbers its messages 1, 2, ... in the order it produces them."""
    return [
        (token, RowBatch.decode(kw["value"]), kw["on_delivery"])
        for token, (_, kw) in enumerate(w.producer.held, 1)
    ]


def steps_of(w: Worker, table: int, rid: int) -> np.ndarray:
    """The local steps the worker holds for row ``rid`` (none if it is not cached)."""
    slot = w.cache.held(table, rid)
    return np.zeros((0, W)) if slot is None else w.pending.steps(table, slot)


def pump(workers, until, timeout_s=40.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            w.poll_once()
        if until():
            return
    raise AssertionError(f"timed out waiting for {what}")


def clicks(user, item, n, t0=None, prefix="c"):
    t0 = t0 or clock.now_ms()
    return [Event(f"{prefix}{user}{item}{j}", "click", user, item, t0 + j) for j in range(n)]


def score(w: Worker, user, item) -> float:
    return float(w.user_row(user) @ w.item_row(item))


def row_redis_key(keys: RedisKeys, table: str, rid: int, family=None) -> str:
    """The hash that holds row ``rid`` (its gradients partition's; the tests' topics have
    ``TEST_PARTITIONS``)."""
    shard = int(row_partitions(np.array([rid], np.int64), TEST_PARTITIONS)[0])
    return (family or keys.embeddings)(table, shard)


def redis_row(conn, table: str, rid: int):
    keys = RedisKeys(conn.topic_prefix)
    blob = connect(conn.redis_url).hget(row_redis_key(keys, table, rid), row_key(rid))
    return None if blob is None else decode_row(blob, W)


def all_applied(r, keys: RedisKeys) -> dict[int, int]:
    return applied_offsets(r, keys, list(range(TEST_PARTITIONS)))


def test_a_click_moves_the_users_row_towards_the_item_before_the_parameter_server_runs(conn):
    w = learner(conn)
    before = score(w, "u1", "i1")
    produce(conn, clicks("u1", "i1", 3))
    pump([w], lambda: w.stats["events"] >= 3, what="the clicks to be learnt")
    assert score(w, "u1", "i1") > before + 0.01
    assert redis_row(conn, "user", row_id("u1")) is None  # no parameter server ran
    w.close()


def gradient_rows(conn, table: int) -> dict[int, list[int]]:
    """Row id -> example counts (a gradient batch's ``versions``) of every gradient row so far."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from freshcore.kafka import consumer_config

    topic = TopicNames(conn.topic_prefix).gradients
    c = Consumer(consumer_config(conn, None))
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    out: dict[int, list[int]] = {}
    idle = 0
    while idle < 3:
        msgs = c.consume(1000, 0.5)
        idle = 0 if msgs else idle + 1
        for m in msgs:
            if m.error() is None:
                b = RowBatch.decode(m.value())
                if b.kind == KIND_GRADIENTS and b.table == table:
                    for rid, n in zip(b.ids.tolist(), b.versions.tolist(), strict=True):
                        out.setdefault(rid, []).append(n)
    c.close()
    return out


def test_admission_holds_a_rows_gradients_until_its_second_touch_then_sends_their_sum(conn):
    w = learner(conn, admission_touches=2)
    before = score(w, "u7", "i7")
    produce(conn, clicks("u7", "i7", 1, prefix="first"))
    pump([w], lambda: w.pending.rows() > 0, what="the first click")
    assert score(w, "u7", "i7") > before  # learnt locally at once
    w.producer.flush(10)
    assert row_id("u7") not in gradient_rows(conn, TABLE_USER)  # held back
    produce(conn, clicks("u7", "i7", 1, prefix="second"))
    sent = {}

    def u7_sent() -> bool:
        w.producer.flush(10)
        sent.update(gradient_rows(conn, TABLE_USER))
        return row_id("u7") in sent

    pump([w], u7_sent, what="u7's gradients after its second touch")
    counts = sent[row_id("u7")]
    assert len(counts) == 1 and counts[0] >= 2  # both touches' examples in one row
    w.close()


def _learn_clicks(w: Worker, pairs) -> None:
    """Learn one click per (user, item), without Kafka: the worker's own ``learn``."""
    from inference.learning.steps import Examples

    n = len(pairs)
    w.learn(
        Examples(
            [u for u, _ in pairs],
            [i for _, i in pairs],
            np.ones(n, np.float32),
            np.ones(n, np.float32),
            np.full(n, clock.now_ms()),
        )
    )


def test_a_held_back_users_steps_do_not_follow_it_out_of_the_slab(conn, monkeypatch):
    """Admission above 1 and a user evicted while its gradients are held back: its steps go
    with its slab row and their pool entries are reused, so they must not travel with its
    gradients when it is admitted later (they would name another step, or one twice)."""
    s = WorkerSettings(conn, LearningSettings(dim=DIM, admission_touches=3), user_capacity_rows=2)
    w = started(s, held=True)
    _learn_clicks(w, [("hA", "hi"), ("hB", "hi")])  # held: one touch each
    _learn_clicks(w, [("hC", "hi"), ("hD", "hi")])  # hA and hB evicted, their steps released
    _learn_clicks(w, [("hE", "hi")])  # hC evicted
    _learn_clicks(w, [("hA", "hi")])  # hA back (hD evicted): its second touch
    _learn_clicks(w, [("hA", "hi")])  # its third: admitted, its gradients sent
    w.send_outbox()
    ((token, batch),) = [(t, b) for t, b, _ in held_gradients(w) if b.table == TABLE_USER]
    assert batch.ids.tolist() == [row_id("hA")]
    p = w.pending
    steps = p._by_token[token]
    # the two steps hA took since it came back, each once; the first went with its old row
    assert len(steps) == 2 and len(set(steps.tolist())) == 2
    assert (p._slot[steps] == w.cache.held(TABLE_USER, row_id("hA"))).all()
    assert (p._table[steps] == p._codes[TABLE_USER]).all()
    w.close()


def test_a_row_forgotten_by_admission_leaves_no_steps_behind(conn):
    """A row unseen for a whole admission window is forgotten with its held gradients; its
    local steps, which will never reach the parameter server, are let go too (they would
    stay in the pool for good)."""
    w = learner(conn, admission_touches=3, admission_window_s=1)
    t0 = clock.now_ms()
    w.forget_unadmitted(t0)  # the filter's first generation starts
    _learn_clicks(w, [("fA", "fi")])
    assert len(steps_of(w, TABLE_USER, row_id("fA"))) == 1
    held = len(w.pending)
    w.forget_unadmitted(t0 + 1_000)  # one window: fA in the previous generation
    w.forget_unadmitted(t0 + 2_000)  # two: forgotten
    assert (TABLE_USER, row_id("fA")) not in w.outbox.held
    assert len(steps_of(w, TABLE_USER, row_id("fA"))) == 0
    assert len(w.pending) < held
    w.close()


def test_a_broadcast_that_fails_is_counted_and_moves_no_broadcast_position(conn):
    from confluent_kafka import KafkaError

    from freshcore import metrics as m
    from param_server.server import ParameterServer
    from param_server.settings import ParamServerSettings

    class Delivered:  # a delivery report's message: where it landed
        def partition(self) -> int:
            return 1

        def offset(self) -> int:
            return 41

    ps = ParameterServer(ParamServerSettings(conn, dim=DIM))
    failed, delivered = m.PS_BROADCASTS.labels("failed"), m.PS_BROADCASTS.labels("delivered")
    f0, d0 = failed._value.get(), delivered._value.get()
    ps._record_broadcast(KafkaError(KafkaError._MSG_TIMED_OUT), None)
    assert failed._value.get() - f0 == 1 and ps._broadcast_positions == {}
    ps._record_broadcast(None, Delivered())
    assert delivered._value.get() - d0 == 1 and ps._broadcast_positions == {1: 41}
    close_producer(ps.producer, 5)
    ps.consumer.close()


def test_gradients_of_one_linger_window_leave_summed_per_row_in_one_message(conn):
    s = WorkerSettings(
        conn,
        LearningSettings(dim=DIM, gradient_linger_ms=60_000),
        user_capacity_rows=1000,
        commit_interval_s=3600.0,
    )
    w = Worker(s)
    w.start()
    u = row_id("u10")
    produce(conn, clicks("u10", "i10", 1, prefix="one"))
    pump([w], lambda: w.pending.rows() > 0, what="the first click")
    produce(conn, clicks("u10", "i10", 1, prefix="two"))
    pump([w], lambda: len(steps_of(w, TABLE_USER, u)) >= 2, what="the second")
    w.producer.flush(10)
    assert u not in gradient_rows(conn, TABLE_USER)  # both wait in the outbox
    w.close()  # sends the outbox
    counts = gradient_rows(conn, TABLE_USER)[u]
    assert len(counts) == 1 and counts[0] >= 2  # one row carrying both slices' examples


def test_each_outbox_message_carries_exactly_the_local_steps_of_its_rows(conn, monkeypatch):
    """Three slices whose rows overlap wait in the outbox and leave summed per row, split by
    partition and by the per-message row cap: every local step is named by the one message
    that carries its row, and no message names a step of a row it does not carry."""
    import inference.assembly as assembly
    from inference.learning.steps import Examples

    monkeypatch.setattr(assembly, "MAX_ROWS_PER_MESSAGE", 3)  # several per partition
    s = WorkerSettings(
        conn, LearningSettings(dim=DIM, gradient_linger_ms=60_000), user_capacity_rows=1000
    )
    w = started(s, held=True)
    rng = np.random.default_rng(7)
    for _ in range(3):
        n = 40
        users = [f"ou{k}" for k in rng.integers(0, 15, n)]
        items = [f"oi{k}" for k in rng.integers(0, 30, n)]
        w.learn(
            Examples(
                users,
                items,
                rng.integers(0, 2, n).astype(np.float32),
                np.ones(n, np.float32),
                np.full(n, clock.now_ms()),
            )
        )
    steps_before = len(w.pending)
    w.send_outbox()
    sent = held_gradients(w)
    assert sent
    p = w.pending
    named = 0
    for token, batch, _ in sent:
        mine = p._by_token[token]  # the steps the message was given
        assert (p._token[mine] == token).all()
        table = batch.table
        slots = set(w.cache.distinct_slots(table, np.sort(batch.ids)).tolist())
        assert set(p._slot[mine].tolist()) == slots  # each of its rows, no other
        assert len(batch.ids) <= 3
        named += len(mine)
        # each row's gradient is the sum over the slices: its steps' deltas over -lr
        at = {slot: j for j, slot in enumerate(w.cache.distinct_slots(table, batch.ids).tolist())}
        steps_sum = np.zeros(batch.rows.shape, np.float64)
        for step in mine.tolist():
            steps_sum[at[int(p._slot[step])]] += p._delta[step]
        np.testing.assert_allclose(batch.rows, steps_sum / -s.learning.lr, rtol=1e-4, atol=1e-6)
    assert named == steps_before == len(p)  # every step, once
    w.close()


def test_an_update_for_a_row_with_an_unacknowledged_step_waits_without_blocking(conn):
    """The update might include that step (its offset is unknown): the row is installed only
    once the delivery report is in, in a later round; the rest of the batch at once."""
    from schemas.rowbatch import KIND_UPDATES

    w = learner(conn)
    produce(conn, clicks("u8", "i8", 1, prefix="ack"))
    pump([w], lambda: w.pending.rows() > 0, what="the click")
    u8, other = row_id("u8"), row_id("u9")
    w.user_row("u9")  # resident, no steps
    acked = {"now": False}
    real = w.pending.waiting
    w.pending.waiting = lambda table, slots: (
        real(table, slots) | (not acked["now"]) & (w.pending.holds(table, slots))
    )
    rows = np.ones((2, W), np.float32)
    update = RowBatch(
        KIND_UPDATES,
        TABLE_USER,
        np.array([u8, other]),
        rows,
        np.array([7, 7], np.uint64),
        np.array([1, 1], np.int64),
        partition=0,
        offset=0,
    )
    w.installer.on_update(update.encode())
    users = w.cache.users
    assert users.version[w.cache.held(TABLE_USER, other)] == 7  # installed at once
    assert users.version[w.cache.held(TABLE_USER, u8)] != 7  # waits for its report
    assert len(w.installer.deferred) == 1
    acked["now"] = True
    w.poll_once()
    assert users.version[w.cache.held(TABLE_USER, u8)] == 7 and not w.installer.deferred
    w.close()


def test_events_are_committed_only_once_the_broker_holds_their_gradients(conn):
    """A crash after the gradients were handed to the producer but before the broker took
    them must not find their events committed: the partition's next owner would start after
    those events, and the gradients died with the producer's queue."""
    from confluent_kafka import TopicPartition

    w = learner(conn, held=True)
    held = w.producer
    produce(conn, clicks("oc-u", "oc-i", 5))
    pump([w], lambda: len(held.held) == 2 and not w.backlog, what="the gradients to leave")
    w.commit(sync=True)
    parts = [
        TopicPartition(w.names.events, p)
        for p in range(partition_count(w.producer, w.names.events))
    ]

    def committed() -> int:
        return sum(max(tp.offset, 0) for tp in w.events.committed(parts, timeout=10))

    assert committed() == 0
    held.release()  # the broker takes them
    w.commit(sync=True)
    assert committed() == 5
    w.close()


def test_a_slice_retried_after_a_redis_error_is_learnt_and_counted_once(conn):
    """Rows that cannot be loaded (Redis down) put the slice back to be learnt later: its
    events are counted when it is learnt, once, and its local steps are taken once."""
    from freshcore import metrics as m

    w = learner(conn)
    real, calls = w.cache.fetch, []

    def flaky(table, ids):
        calls.append(table)
        if len(calls) == 1:
            raise redis_lib.ConnectionError("injected outage")
        return real(table, ids)

    w.cache.fetch = flaky
    valid = m.WORKER_EVENTS.labels("valid")
    before = valid._value.get()
    produce(conn, clicks("u14", "i14", 3, prefix="retry"))
    pump([w], lambda: valid._value.get() - before >= 3, what="the retried slice")
    for _ in range(20):
        w.poll_once()
    w.send_outbox()
    assert valid._value.get() - before == 3 and len(calls) >= 2
    assert len(steps_of(w, TABLE_USER, row_id("u14"))) == 1  # one step, not two
    w.close()


def test_parameter_server_applies_persists_and_broadcasts_with_rising_versions(conn, tmp_path):
    a = learner(conn)
    with service(conn, "param-server", tmp_path / "ps.log", **ENV):
        produce(conn, clicks("u2", "i2", 2, prefix="a"))
        pump([a], lambda: redis_row(conn, "item", row_id("i2")) is not None, what="persisted row")
        b = learner(conn)  # a second worker: loads the item table, follows the broadcast
        slot = b.cache.held(TABLE_ITEM, row_id("i2"))
        assert slot is not None
        v1 = int(b.cache.items.version[slot])
        assert v1 >= 1
        produce(conn, clicks("u2", "i2", 2, prefix="b"))
        pump([a, b], lambda: int(b.cache.items.version[slot]) > v1, what="the broadcast to reach b")
        pump(
            [a, b],
            lambda: int(b.cache.items.version[slot]) == redis_row(conn, "item", row_id("i2"))[1],
            what="b to catch up",
        )
        np.testing.assert_allclose(
            b.item_row("i2"), redis_row(conn, "item", row_id("i2"))[0], rtol=1e-6
        )
        a.close()
        b.close()


def test_read_your_writes_local_steps_survive_slow_broadcasts_and_converge(conn, tmp_path):
    w = learner(conn)
    with service(
        conn, "param-server", tmp_path / "ps.log", **{**ENV, "FRESHREC_FLUSH_INTERVAL_MS": "1500"}
    ):
        best = -np.inf
        t0 = clock.now_ms()
        for round_ in range(4):
            learnt = w.stats["events"]
            produce(conn, clicks("u3", "i3", 2, t0 + 10 * round_, prefix=f"r{round_}"))
            pump([w], lambda n=learnt: w.stats["events"] >= n + 2, timeout_s=20, what="local step")
            s = score(w, "u3", "i3")
            assert s >= best - 1e-6, "a broadcast undid a local step"
            best = s
            for _ in range(40):  # let slow broadcasts arrive in between
                w.poll_once()
                assert score(w, "u3", "i3") >= best - 1e-6
        pump([w], lambda: len(w.pending) == 0, timeout_s=30, what="all steps included")
        row, _, _ = redis_row(conn, "user", row_id("u3"))
        np.testing.assert_allclose(w.user_row("u3"), row, rtol=1e-5, atol=1e-6)
    w.close()


def test_with_the_parameter_server_down_the_step_pool_stays_bounded_and_rows_converge(
    conn, tmp_path
):
    """No broadcast takes steps out of the read-your-writes pool while the parameter server
    is down: past its bound the oldest sent steps are let go and learning goes on; once the
    server is back every row still ends as the server's row."""
    from freshcore import metrics as m

    w = learner(conn, max_pending_steps=40)
    let_go = m.PENDING_STEPS_LET_GO._value.get()
    users = [f"pb{k}-{j}" for k in range(10) for j in range(6)]
    for k in range(10):
        _learn_clicks(w, [(f"pb{k}-{j}", f"pi{j % 3}") for j in range(6)])  # 9 steps a slice
        w.send_outbox()
        w.producer.flush(10)  # sent and delivered: steps the next trim may let go
        assert len(w.pending) <= 40 + 9
    assert w.stats["pending_let_go"] > 0
    assert m.PENDING_STEPS_LET_GO._value.get() - let_go == w.stats["pending_let_go"]
    with service(conn, "param-server", tmp_path / "ps.log", **ENV):

        def converged() -> bool:
            for u in users:
                got = redis_row(conn, "user", row_id(u))
                if got is None or not np.allclose(w.user_row(u), got[0], rtol=1e-5, atol=1e-6):
                    return False
            return len(w.pending) == 0

        pump([w], converged, timeout_s=40, what="every row to be the parameter server's")
    w.close()


def test_the_newest_event_time_of_each_stage_is_exposed(conn):
    """``freshrec_freshness_event_timestamp_seconds``: the newest event time the worker learnt,
    the parameter server persisted, and the worker installed from its broadcast."""
    import threading

    from freshcore import metrics as m
    from param_server.server import ParameterServer
    from param_server.settings import ParamServerSettings

    newest = {s: m.FRESHNESS_EVENT_TIME.labels(s) for s in ("local", "global_applied", "served")}
    w = learner(conn)
    t0 = clock.now_ms()
    produce(conn, clicks("nt-u", "nt-i", 3, t0))
    want = (t0 + 2) / 1000  # the third click's

    def reached(stage: str) -> bool:
        return newest[stage]._value.get() == pytest.approx(want, abs=1e-6)

    pump([w], lambda: reached("local"), what="the clicks to be learnt")
    ps = ParameterServer(ParamServerSettings(conn, dim=DIM, flush_interval_ms=20))
    stop_ps = threading.Event()
    thread = threading.Thread(target=ps.run, args=(stop_ps,), daemon=True)
    thread.start()
    try:
        pump([w], lambda: reached("served"), what="the broadcast rows to be installed")
        assert reached("global_applied") and reached("local")
    finally:
        stop_ps.set()
        thread.join(30)
    w.close()


def gradient_messages(
    n_messages: int, seed: int = 0, poison: bool = False
) -> list[tuple[int, bytes]]:
    """A long, deterministic stream of gradient messages on 4 partitions."""
    rng = np.random.default_rng(seed)
    by_part = {q: [i for i in range(400) if kafka_partition(row_key(i), 4) == q] for q in range(4)}
    out = []
    for j in range(n_messages):
        part = int(rng.integers(0, 4))
        ids = np.array(rng.choice(by_part[part], 5, replace=False), np.int64)
        g = rng.standard_normal((5, W)).astype(np.float32)
        if poison and j % 10 == 3:
            g[0, 0] = np.nan
            g[1] *= 1e30
        batch = RowBatch(
            KIND_GRADIENTS,
            TABLE_USER,
            ids,
            g,
            np.ones(5, np.uint64),
            np.full(5, 1_767_225_600_000 + j),
        )
        out.append((part, batch.encode()))
    return out


def send(conn, messages) -> None:
    names = TopicNames(conn.topic_prefix)
    p = Producer(producer_config(conn))
    for part, value in messages:
        p.produce(names.gradients, value=value, partition=part)
    assert p.flush(30) == 0


def gradient_stream(conn, n_messages: int, seed: int = 0, poison: bool = False) -> None:
    send(conn, gradient_messages(n_messages, seed, poison))


def tables(conn) -> dict[int, tuple]:
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    out = {}
    for shard in range(TEST_PARTITIONS):
        for k, v in r.hgetall(keys.embeddings("user", shard)).items():
            row, version, _ = decode_row(v, W)
            out[k] = (row, version)
    return out


def applied_total(conn) -> int:
    r = connect(conn.redis_url)
    return sum(v + 1 for v in all_applied(r, RedisKeys(conn.topic_prefix)).values())


N_MESSAGES = 400


@pytest.fixture(scope="module")
def reference_tables(services, tmp_path_factory):
    """Tables after one uninterrupted parameter-server run over the gradient stream."""
    import uuid

    from confluent_kafka.admin import AdminClient

    from freshcore.kafka import admin_config
    from freshcore.topics import catalogue_with, ensure_topics

    from .conftest import TEST_PARTITIONS

    prefix = f"ref{uuid.uuid4().hex[:8]}."
    conn = services.conn(prefix)
    ensure_topics(
        AdminClient(admin_config(conn)),
        prefix,
        catalogue_with({n: TEST_PARTITIONS for n in ("events", "recommend.requests", "gradients")}),
    )
    gradient_stream(conn, N_MESSAGES)
    with service(conn, "param-server", tmp_path_factory.mktemp("ref") / "ps.log", **ENV):
        wait_for(lambda: applied_total(conn) == N_MESSAGES, 60, "reference run")
    return tables(conn)


def assert_same_tables(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k][0], want[k][0], rtol=1e-6, atol=1e-7)
        assert got[k][1] == want[k][1]  # versions: every message applied exactly once


def test_sigkill_mid_stream_and_restart_give_the_uninterrupted_tables(
    any_conn, tmp_path, reference_tables
):
    conn = any_conn
    messages = gradient_messages(N_MESSAGES)
    with service(
        conn, "param-server", tmp_path / "ps1.log", **{**ENV, "FRESHREC_FLUSH_INTERVAL_MS": "5"}
    ) as proc:
        send(conn, messages[:150])
        wait_for(lambda: applied_total(conn) > 0, 60, "some progress")
        stop(proc, signal.SIGKILL)
    done = applied_total(conn)
    assert 0 < done <= 150
    send(conn, messages[150:])
    with service(conn, "param-server", tmp_path / "ps2.log", **ENV):
        wait_for(lambda: applied_total(conn) == N_MESSAGES, 60, "the restarted server to finish")
    assert "resuming after offsets" in (tmp_path / "ps2.log").read_text()
    assert_same_tables(tables(conn), reference_tables)


def test_a_transaction_redis_acknowledged_and_lost_is_written_again(
    conn, tmp_path, reference_tables
):
    """After a failover Redis may have lost a transaction its master acknowledged
    (replication is asynchronous): the rows only that transaction wrote are stale there,
    while the applied offsets move on with the next one. The parameter server reads the
    offsets back before each transaction, finds them behind, and writes every row those
    partitions updated again: the tables end equal to an uninterrupted run's. Simulated by
    putting the keys back as they were (DUMP/RESTORE) after a transaction."""
    r = redis_lib.Redis.from_url(conn.redis_url)
    messages = gradient_messages(N_MESSAGES)
    log_path = tmp_path / "ps.log"

    def state_keys() -> list[bytes]:
        return [k for k in r.scan_iter(match=f"{conn.topic_prefix}*") if b"owner" not in k]

    env = {**ENV, "FRESHREC_FLUSH_INTERVAL_MS": "5", "FRESHREC_ROW_TTL_S": "0"}  # no eviction
    with service(conn, "param-server", log_path, **env):
        send(conn, messages[:150])
        wait_for(lambda: applied_total(conn) == 150, 60, "the first 150")
        before = {k: r.dump(k) for k in state_keys()}
        send(conn, messages[150:300])
        wait_for(lambda: applied_total(conn) == 300, 60, "the next 150")
        for k in state_keys():  # the failover: the writes of messages 150-299 are gone
            if k not in before:
                r.delete(k)
        for k, blob in before.items():
            r.restore(k, 0, blob, replace=True)
        assert applied_total(conn) == 150
        send(conn, messages[300:])
        wait_for(lambda: applied_total(conn) == N_MESSAGES, 60, "the rest")
        wait_for(
            lambda: (
                {k: v[1] for k, v in tables(conn).items()}
                == {k: v[1] for k, v in reference_tables.items()}
            ),
            60,
            "the lost rows written again",
        )
    assert "lost an acknowledged transaction" in log_path.read_text()
    assert_same_tables(tables(conn), reference_tables)


def updates_from_the_start(conn):
    """A group-less consumer of every ``embeddings.updates`` partition from its start."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from freshcore.kafka import consumer_config

    topic = TopicNames(conn.topic_prefix).embeddings_updates
    updates = Consumer(consumer_config(conn, None))
    parts = updates.list_topics(topic, timeout=10).topics[topic].partitions
    updates.assign([TopicPartition(topic, q, OFFSET_BEGINNING) for q in parts])
    return updates


def test_a_row_is_broadcast_only_once_redis_holds_it(conn, monkeypatch):
    """The persist is pipelined (sent by a thread while the next messages are applied); made
    slow here, every broadcast row must still be in Redis, at its version or newer, and every
    broadcast offset applied there, by the time a worker could read the update."""
    import threading

    import param_server.server as ps_module
    from param_server.server import ParameterServer
    from param_server.settings import ParamServerSettings

    real_persist = ps_module.persist_fenced

    def slow_persist(*args, **kwargs):
        time.sleep(0.2)
        return real_persist(*args, **kwargs)

    monkeypatch.setattr(ps_module, "persist_fenced", slow_persist)
    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    messages = gradient_messages(120, seed=3)
    ps = ParameterServer(ParamServerSettings(conn, dim=DIM, flush_interval_ms=20))
    stop_ps = threading.Event()
    thread = threading.Thread(target=ps.run, args=(stop_ps,), daemon=True)
    updates = updates_from_the_start(conn)
    thread.start()
    try:
        send(conn, messages)
        seen, deadline = 0, time.monotonic() + 60
        while applied_total(conn) < len(messages) or seen == 0:
            assert time.monotonic() < deadline, "the parameter server did not finish"
            for msg in updates.consume(100, 0.05):
                if msg.error() is not None:
                    continue
                batch = RowBatch.decode(msg.value())
                stored = [
                    r.hget(row_redis_key(keys, "user", i), row_key(i)) for i in batch.ids.tolist()
                ]
                assert all(b is not None for b in stored), "broadcast before persisted"
                versions = [decode_row(b, W)[1] for b in stored]
                assert all(v >= u for v, u in zip(versions, batch.versions.tolist(), strict=True))
                assert all_applied(r, keys)[batch.partition] >= batch.offset
                seen += 1
    finally:
        stop_ps.set()
        thread.join(30)
        updates.close()
    assert seen > 0


def test_a_parameter_server_set_to_float16_broadcasts_half_rows_workers_read(conn):
    """``FRESHREC_UPDATES_FP16``: every broadcast batch is layout 3 (float16 rows), decoded to
    the rows Redis holds, rounded to float16."""
    import struct
    import threading

    from param_server.server import ParameterServer
    from param_server.settings import ParamServerSettings

    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    ps = ParameterServer(ParamServerSettings(conn, dim=DIM, updates_half=True))
    stop_ps = threading.Event()
    thread = threading.Thread(target=ps.run, args=(stop_ps,), daemon=True)
    updates = updates_from_the_start(conn)
    thread.start()
    try:
        send(conn, gradient_messages(40, seed=5))
        batches = []
        deadline = time.monotonic() + 60
        while applied_total(conn) < 40 or not batches:
            assert time.monotonic() < deadline, "no broadcast"
            batches += [msg.value() for msg in updates.consume(100, 0.05) if msg.error() is None]
    finally:
        stop_ps.set()
        thread.join(30)
        updates.close()
    for raw in batches:
        assert struct.unpack_from("<H", raw, 4) == (3,)
        batch = RowBatch.decode(raw)
        for i, row, version in zip(batch.ids, batch.rows, batch.versions, strict=True):
            stored, stored_version, _ = decode_row(
                r.hget(row_redis_key(keys, "user", int(i)), row_key(int(i))), W
            )
            if stored_version == version:  # not updated again since
                np.testing.assert_array_equal(row, stored.astype(np.float16).astype(np.float32))


def test_a_transaction_is_written_only_while_its_partitions_are_owned(conn):
    from param_server.store import claim_partitions, pack_persist, persist_fenced

    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    ids = np.array([5], np.int64)
    row = np.ones((1, W), np.float32)
    table = {2: {TABLE_USER: (ids, row, row, np.ones(1, np.uint64), np.array([1_000]))}}
    units = pack_persist(keys, table, {2: 10})
    claim_partitions(r, keys, {2: "a-1"})
    assert persist_fenced(r, keys, units, {2: "a-1"})
    assert all_applied(r, keys) == {2: 10}
    claim_partitions(r, keys, {2: "b-1"})  # another instance took partition 2 over
    later = pack_persist(keys, table, {2: 11})
    assert not persist_fenced(r, keys, later, {2: "a-1"})
    assert all_applied(r, keys) == {2: 10}  # the fenced-off write left nothing
    assert persist_fenced(r, keys, later, {2: "b-1"})
    assert all_applied(r, keys) == {2: 11}


def test_a_stalled_instance_whose_partitions_were_claimed_writes_nothing_and_stops(conn):
    """A parameter server that lost its partitions while stalled (here: another instance's
    claim written behind its back) must not overwrite the new owner's rows and offsets."""
    import threading

    from param_server.server import FencedOff, ParameterServer
    from param_server.settings import ParamServerSettings
    from param_server.store import claim_partitions

    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    messages = gradient_messages(80, seed=5)
    ps = ParameterServer(ParamServerSettings(conn, dim=DIM, flush_interval_ms=20))
    stop_ps, failure = threading.Event(), []

    def run() -> None:
        try:
            ps.run(stop_ps)
        except FencedOff as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        send(conn, messages[:40])
        wait_for(lambda: applied_total(conn) == 40, 60, "the first half")
        claim_partitions(r, keys, {p: "another-instance" for p in range(4)})
        before = (all_applied(r, keys), tables(conn))
        send(conn, messages[40:])
        thread.join(30)
        assert failure and not thread.is_alive(), "the fenced-off instance kept running"
        after = (all_applied(r, keys), tables(conn))
        assert after[0] == before[0]  # no offset moved after the claim
        assert after[1].keys() == before[1].keys()
        for k, (row, version) in before[1].items():
            assert after[1][k][1] == version and np.array_equal(after[1][k][0], row)
    finally:
        stop_ps.set()
        thread.join(30)


def test_two_instances_share_partitions_and_one_takes_over_when_the_other_dies(
    any_conn, tmp_path, reference_tables
):
    conn = any_conn
    with (
        service(conn, "param-server", tmp_path / "a.log", **ENV) as a,
        service(conn, "param-server", tmp_path / "b.log", **ENV),
    ):

        def both_assigned():
            logs = [(tmp_path / n).read_text() for n in ("a.log", "b.log")]
            return all(
                "assigned gradients partitions [" in x
                and "assigned gradients partitions []"
                not in x.split("assigned gradients partitions")[-1][:4]
                for x in logs
            )

        wait_for(both_assigned, 60, "both instances to own partitions")
        stop(a, signal.SIGKILL)
        gradient_stream(conn, N_MESSAGES)
        wait_for(lambda: applied_total(conn) == N_MESSAGES, 90, "the survivor to finish the work")
    assert_same_tables(tables(conn), reference_tables)


def test_non_finite_and_exploding_gradients_never_reach_a_table(conn, tmp_path):
    gradient_stream(conn, 100, seed=5, poison=True)
    with service(conn, "param-server", tmp_path / "ps.log", **ENV):
        wait_for(lambda: applied_total(conn) == 100, 60, "all messages")
    rows = tables(conn)
    assert rows
    lr = 0.05
    for row, version in rows.values():
        assert np.isfinite(row).all()
        # Adagrad moves each element by at most lr per step; initial rows have norm ~0.3
        steps = int(updates_since_creation(version))
        assert 0 < steps <= 100
        assert np.linalg.norm(row) <= 1.0 + lr * np.sqrt(W) * steps


def test_rows_not_updated_for_the_ttl_expire_and_come_back_at_a_newer_version(conn, tmp_path):
    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    t0 = clock.now_ms()
    row = 7
    part = kafka_partition(row_key(row), 4)

    def one(t_ms: int) -> list[tuple[int, bytes]]:
        g = np.full((1, W), 0.1, np.float32)
        batch = RowBatch(
            KIND_GRADIENTS,
            TABLE_USER,
            np.array([row], np.int64),
            g,
            np.ones(1, np.uint64),
            np.array([t_ms]),
        )
        return [(part, batch.encode())]

    env = {**ENV, "FRESHREC_ROW_TTL_S": "2"}
    with service(conn, "param-server", tmp_path / "ps1.log", **env):
        send(conn, one(t0) + one(t0 + 1))
        wait_for(lambda: applied_total(conn) == 2, 60, "two updates")
        # read at once: the row lives two seconds after its last write
        stored = redis_row(conn, "user", row)
        ttl = [
            r.execute_command("HPTTL", key, "FIELDS", 1, row_key(row))[0]
            for key in (
                row_redis_key(keys, "user", row),
                row_redis_key(keys, "user", row, keys.optimizer),
            )
        ]
    assert stored is not None, "the row expired before it could be read"
    assert stored[1] == int(version_floor(np.array([t0]))[0]) + 2  # created, then two updates
    assert all(0 < t <= 2000 for t in ttl), ttl
    wait_for(lambda: redis_row(conn, "user", row) is None, 10, "the row to expire")
    # a later gradient creates it anew: from its initial row, at a version above the old one
    send(conn, one(t0 + 5_000))  # a later second: a higher floor
    with service(conn, "param-server", tmp_path / "ps2.log", **env):
        wait_for(lambda: applied_total(conn) == 3, 60, "the third update")
        again = redis_row(conn, "user", row)
    assert again is not None, "the row expired before it could be read"
    assert again[1] > stored[1] and int(updates_since_creation(again[1])) == 1


@pytest.mark.parametrize("expiry", [HSETEX, HPEXPIRE, None])
def test_persist_sets_each_fields_ttl_with_either_expiry_command(conn, expiry):
    """HSETEX (Redis 8, Valkey 9) and HSET + HPEXPIRE (Redis 7.4) write the same rows with
    the same time-to-live; without an expiry command the fields stay forever."""
    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(f"{conn.topic_prefix}{expiry}.")
    if expiry == HSETEX and field_expiry(r, keys) != HSETEX:
        pytest.skip("this Redis has no HSETEX (Redis 7.4: the parameter server uses HPEXPIRE)")
    ids = np.array([3, 11], np.int64)
    rows = np.arange(2 * W, dtype=np.float32).reshape(2, W)
    accum = rows + 0.5
    versions, times = np.array([4, 9], np.uint64), np.array([1_000, 2_000], np.int64)
    table = {0: {TABLE_USER: (ids, rows, accum, versions, times)}}
    claim_partitions(r, keys, {0: "ttl-test"})
    units = pack_persist(keys, table, {0: 41}, ttl_ms=60_000, expiry=expiry)
    assert persist_fenced(r, keys, units, {0: "ttl-test"})
    got = fetch_rows_and_accumulators(r, keys, {TABLE_USER: ids}, W, 1)[TABLE_USER]
    assert got.found.all() and got.has_accum.all()
    assert np.array_equal(got.rows, rows) and np.array_equal(got.accum, accum)
    assert got.versions.tolist() == [4, 9] and got.event_ms.tolist() == [1_000, 2_000]
    assert applied_offsets(r, keys, [0]) == {0: 41}
    for key in (keys.embeddings("user", 0), keys.optimizer("user", 0)):
        ttl = r.execute_command("HPTTL", key, "FIELDS", 2, *(row_key(i) for i in ids))
        if expiry is None:
            assert ttl == [-1, -1]  # no expiry on the fields
        else:
            assert all(59_000 < t <= 60_000 for t in ttl), ttl


def test_a_restarted_worker_reloads_rows_from_redis_and_continues(conn, tmp_path):
    with service(conn, "param-server", tmp_path / "ps.log", **ENV):
        a = learner(conn)
        produce(conn, clicks("u9", "i9", 3, prefix="w1"))
        pump(
            [a],
            lambda: redis_row(conn, "user", row_id("u9")) is not None and len(a.pending) == 0,
            what="persisted",
        )
        a.close()
        b = learner(conn)
        stored, version, _ = redis_row(conn, "user", row_id("u9"))
        np.testing.assert_allclose(b.user_row("u9"), stored, rtol=1e-6)
        slot = b.cache.held(TABLE_USER, row_id("u9"))
        assert int(b.cache.users.version[slot]) == version
        before = score(b, "u9", "i9")
        produce(conn, clicks("u9", "i9", 2, prefix="w2"))
        pump([b], lambda: score(b, "u9", "i9") > before + 1e-3, what="learning to continue")
        b.close()


def test_parameter_server_pauses_while_redis_is_unavailable_and_resumes(
    services, conn, tmp_path, reference_tables
):
    """A private Redis frozen (SIGSTOP) mid-stream: the server waits, loses nothing, finishes."""
    import os

    with private_redis(conn) as (private, rproc):
        messages = gradient_messages(N_MESSAGES)
        env = {**ENV, "REDIS_URL": private.redis_url}
        with service(conn, "param-server", tmp_path / "ps.log", **env):
            send(conn, messages[:100])
            wait_for(lambda: applied_total(private) > 0, 60, "some progress")
            os.kill(rproc.pid, signal.SIGSTOP)
            send(conn, messages[100:])
            # frozen until the server has noticed (its 5 s socket timeout, after its next flush
            # started: on a loaded machine that is not at a fixed time)
            log_path = tmp_path / "ps.log"
            wait_for(
                lambda: "Redis unavailable" in log_path.read_text(), 60, "the server to notice"
            )
            os.kill(rproc.pid, signal.SIGCONT)
            wait_for(
                lambda: applied_total(private) == N_MESSAGES, 90, "the server to resume and finish"
            )
        log = (tmp_path / "ps.log").read_text()
        assert "Redis unavailable" in log and "Redis is back" in log
        assert_same_tables(tables(private), reference_tables)


def test_a_revoke_served_while_redis_is_down_persists_no_offset_ahead_of_its_rows(
    conn, monkeypatch
):
    """While Redis is down the parameter server polls its consumer to stay in the group, and
    that poll may serve a rebalance: the revoke's flush must persist only offsets whose
    messages it applied, and the messages in hand are applied by whoever owns their
    partition afterwards. (The offsets used to advance before the rows were loaded: a revoke
    during that load persisted an offset past a message never applied — a lost gradient.)
    Redis and the broker are real; the outage (one failed row load) and the revoke served
    by the retry's poll are injected."""
    from confluent_kafka import TopicPartition

    import param_server.server as ps_module
    from param_server.server import ParameterServer
    from param_server.settings import ParamServerSettings
    from param_server.store import claim_partitions

    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    names = TopicNames(conn.topic_prefix)
    t0 = 1_767_225_600_000

    def grad(ids, j):
        g = np.full((len(ids), W), 0.1 * (j + 1), np.float32)
        return RowBatch(
            KIND_GRADIENTS,
            TABLE_USER,
            np.array(ids, np.int64),
            g,
            np.ones(len(ids), np.uint64),
            np.full(len(ids), t0 + j),
        )

    first, second = grad([1, 2], 0), grad([2, 3], 1)  # row 3 is not held: it is loaded

    def run(ps, fail_load: bool):
        """Offset 0, then offset 1 of partition 0; optionally Redis down during the second
        message's row load, with a revoke served by the retry's poll."""
        ps.owned, ps.applied = {0}, {0: -1}
        ps.owner = {0: f"{ps.instance}-1"}
        claim_partitions(r, keys, ps.owner)
        ps.apply_messages([(0, 0, first)])
        if fail_load:
            real_fetch, calls = ps_module.fetch_rows_and_accumulators, []

            def fetch_once_down(*args, **kwargs):
                calls.append(1)
                if len(calls) == 1:
                    raise redis_lib.ConnectionError("injected outage")
                return real_fetch(*args, **kwargs)

            class RevokingConsumer:  # the retry's poll serves a rebalance: a revoke
                def __init__(self) -> None:
                    self.revoked = False

                def poll(self, timeout):
                    if not self.revoked:
                        self.revoked = True
                        ps._on_revoke(self, [TopicPartition(names.gradients, 0)])

                def assignment(self):
                    return []

            monkeypatch.setattr(ps_module, "fetch_rows_and_accumulators", fetch_once_down)
            monkeypatch.setattr(ps_module.time, "sleep", lambda s: None)
            ps.consumer.close()
            ps.consumer = RevokingConsumer()
            ps.apply_messages([(0, 1, second)])
            monkeypatch.undo()
            assert all_applied(r, keys) == {0: 0}, "an offset persisted past its rows"
            assert not ps.dirty_rows, "rows applied for a partition no longer owned"
            # the next owner (here a fresh instance) resumes after the persisted offset
            close_producer(ps.producer, 10)
            ps = ParameterServer(ParamServerSettings(conn, dim=DIM))
            ps.owned, ps.applied = {0}, {0: 0}
            ps.owner = {0: f"{ps.instance}-1"}
            claim_partitions(r, keys, ps.owner)
        ps.apply_messages([(0, 1, second)])
        ps.flush(sync=True)
        ps.consumer.close()
        ps._persister.shutdown()
        close_producer(ps.producer, 10)  # an open one logs failed reconnects at the stack's stop
        return tables(conn), all_applied(r, keys)

    interrupted = run(ParameterServer(ParamServerSettings(conn, dim=DIM)), fail_load=True)
    for k in r.keys(f"{conn.topic_prefix}*"):
        r.delete(k)
    uninterrupted = run(ParameterServer(ParamServerSettings(conn, dim=DIM)), fail_load=False)
    assert interrupted[1] == uninterrupted[1] == {0: 1}
    assert interrupted[0].keys() == uninterrupted[0].keys()
    for k, (row, version) in uninterrupted[0].items():
        assert interrupted[0][k][1] == version and np.array_equal(interrupted[0][k][0], row)


def test_items_untouched_for_the_row_ttl_leave_the_table_catalogue_items_stay(conn):
    """The worker's item table is bounded like the store's: an item that no event and no
    broadcast has touched for ``FRESHREC_ROW_TTL_S`` leaves it, with its local steps, and
    its slot is reused; an item the catalogue lists stays (serving needs its row)."""
    from freshcore.rediskeys import RedisKeys
    from schemas.records import Item
    from streams.catalogue import queue_catalogue

    keys = RedisKeys(conn.topic_prefix)
    pipe = redis_lib.Redis.from_url(conn.redis_url).pipeline(transaction=False)
    queue_catalogue(pipe, keys, [Item("xk", "c1", 1.0, 1_700_000_000_000)], 0)
    pipe.execute()
    w = learner(conn)  # the catalogue adopted at start: xk is listed
    now = [clock.now_ms()]
    w.cache.clock = lambda: now[0]
    _learn_clicks(w, [("xu", "xk"), ("xu", "xg")])
    now[0] += 10_000
    _learn_clicks(w, [("xu", "xr")])  # touched 10 s later
    slot_g = w.cache.held(TABLE_ITEM, row_id("xg"))
    assert len(steps_of(w, TABLE_ITEM, row_id("xg"))) == 1
    held = len(w.pending)
    ttl_ms = w.settings.row_ttl_s * 1000
    assert w.expire_items(now[0] + ttl_ms - 5_000) == 1  # xg: untouched for the TTL
    assert w.cache.held(TABLE_ITEM, row_id("xg")) is None
    assert len(w.pending.steps(TABLE_ITEM, slot_g)) == 0 and len(w.pending) == held - 1
    assert w.cache.held(TABLE_ITEM, row_id("xk")) is not None  # listed: stays, untouched
    assert w.cache.held(TABLE_ITEM, row_id("xr")) is not None
    # a new item takes the slot, from its initial row (nothing of xg's left in it)
    np.testing.assert_array_equal(
        w.item_row("xn"), initial_rows(np.array([row_id("xn")]), TABLE_ITEM, DIM)[0]
    )
    assert w.cache.held(TABLE_ITEM, row_id("xn")) == slot_g
    w.close()
