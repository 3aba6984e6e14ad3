"""The rules every service shares, written once in the kernel: waiting out a Redis outage,
delivery retry, partition counting, the service shape."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import redis

from freshcore import metrics as m
from freshcore.kafka import TopicMissing, delivery_retriable, partition_count
from freshcore.outage import StopRequested, is_outage, until_redis_answers
from freshcore.retry import RetryPolicy, RetryQueue
from freshcore.service import Service
from schemas.errors import FreshRecError, RetriableError


def test_an_outage_is_waited_out_and_other_errors_pass_through(caplog):
    caplog.set_level(logging.INFO, "freshcore.outage")
    calls, waits, slept = [], [], []

    def op():
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("refused")
        return "done"

    got = until_redis_answers(op, "test", while_waiting=waits.append, sleep=slept.append)
    assert got == "done" and len(calls) == 3
    assert waits == [True, False] and slept == [1.0, 1.0]
    assert "Redis unavailable" in caplog.text and "Redis is back" in caplog.text

    def refused():
        raise redis.ResponseError("WRONGTYPE")

    with pytest.raises(redis.ResponseError):
        until_redis_answers(refused, "test", sleep=slept.append)
    # refusals that pass with time are waited out like an outage: memory at maxmemory, a
    # cluster re-forming
    # cluster re-forming; both as text and as the classes redis-py's parser makes of them
    # (it drops the word OOM from an OutOfMemoryError's text: the text alone once let a
    # service at maxmemory crash)
    refusals = iter(
        [
            redis.ResponseError("OOM command not allowed"),
            redis.ResponseError("CLUSTERDOWN"),
            redis.exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'."
            ),
            redis.exceptions.ClusterDownError("The cluster is down"),
            redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
            redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        ]
    )

    def crowded():
        err = next(refusals, None)
        if err is not None:
            raise err
        return "written"

    oom = m.REDIS_UNAVAILABLE.labels("oom")._value.get()
    assert until_redis_answers(crowded, "test", sleep=slept.append) == "written"
    assert m.REDIS_UNAVAILABLE.labels("oom")._value.get() == oom + 2
    assert m.REDIS_WAITING._value.get() == 0  # the wait is over
    assert is_outage(redis.TimeoutError()) and is_outage(RetriableError("x"))
    assert not is_outage(FreshRecError("x")) and not is_outage(ValueError())


def test_a_stop_asked_for_during_a_wait_ends_it():
    stop, calls = threading.Event(), []

    def op():
        calls.append(1)
        stop.set()  # asked to stop while the first attempt failed
        raise redis.ConnectionError("refused")

    with pytest.raises(StopRequested, match="test: asked to stop while waiting for Redis"):
        until_redis_answers(op, "test", wait_s=60, stop=stop)  # returns at once, not in 60 s
    assert calls == [1]
    assert m.REDIS_WAITING._value.get() == 0


def test_a_retry_policy_spends_its_attempts_and_backs_off():
    replies = RetryQueue(RetryPolicy(attempts=3, first_wait_s=0.0))
    assert replies.add("r", 1, now=10.0) and replies.add("r", 2, now=10.0)
    assert not replies.add("r", 3, now=10.0)  # the third failure: undeliverable
    assert replies.due(10.0) == [("r", 2), ("r", 3)] and len(replies) == 0
    gradients = RetryQueue(RetryPolicy(attempts=None, first_wait_s=2.0, max_wait_s=30.0))
    for attempt in (1, 2, 10):
        assert gradients.add(attempt, attempt, now=0.0)
    assert gradients.due(1.9) == []
    assert gradients.due(2.0) == [(1, 2)]
    assert gradients.due(4.0) == [(2, 3)]
    assert gradients.drain() == [(10, 11)]  # 30 s, capped


def test_which_delivery_errors_may_pass():
    from confluent_kafka import KafkaError

    assert delivery_retriable(KafkaError(KafkaError._MSG_TIMED_OUT))
    assert not delivery_retriable(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))


def test_partitions_are_counted_from_every_topics_metadata():
    asked = []

    class Client:
        def list_topics(self, topic=None, timeout=None):
            asked.append(topic)  # a request naming a topic may create it
            ok = SimpleNamespace(error=None, partitions={0: 0, 1: 1, 2: 2})
            return SimpleNamespace(topics={"t.events": ok})

    assert partition_count(Client(), "t.events") == 3 and asked == [None]
    with pytest.raises(TopicMissing, match="freshrec topics create"):
        partition_count(Client(), "t.missing")


class _Counting(Service):
    name = "test"
    beats = False

    def __init__(self, fail_at: int | None, stop: threading.Event) -> None:
        self.fail_at, self.stop_at, self.stop = fail_at, 3, stop
        self.rounds, self.started, self.closed = 0, False, []

    def start(self):
        self.started = True

    def poll_once(self):
        self.rounds += 1
        if self.rounds == self.fail_at:
            raise RuntimeError("broken batch")
        if self.rounds == self.stop_at:
            self.stop.set()

    def close(self, clean):
        self.closed.append(clean)


def test_the_service_shape_closes_once_and_says_whether_cleanly():
    stop = threading.Event()
    ok = _Counting(None, stop)
    ok.run(stop)
    assert ok.started and ok.rounds == 3 and ok.closed == [True] and ok.stopping
    stop = threading.Event()
    broken = _Counting(2, stop)
    with pytest.raises(RuntimeError):
        broken.run(stop)
    assert broken.closed == [False]  # a failed batch commits nothing


def test_broadcast_positions_redis_refuses_are_kept_for_the_next_round():
    """The parameter server's start positions for new workers: a write that Redis refuses at
    maxmemory (redis-py's OutOfMemoryError) once ended the server; now the positions wait for
    the next round, merged with newer ones, and any other error still surfaces."""
    from param_server.server import ParameterServer

    class Refusing:
        def __init__(self, exc):
            self.exc, self.written = exc, []

        def hset(self, key, mapping):
            if self.exc is not None:
                raise self.exc
            self.written.append(dict(mapping))

    ps = object.__new__(ParameterServer)  # the one method alone: no broker, no Redis
    ps.keys = type("Keys", (), {"ps_broadcast": "t.ps:broadcast"})()
    ps.redis = Refusing(redis.exceptions.OutOfMemoryError("command not allowed"))
    ps._broadcast_positions = {0: 5, 1: 7}
    ps._save_broadcast_positions()
    assert ps._broadcast_positions == {0: 5, 1: 7}
    ps._broadcast_positions[0] = 9  # a newer delivery meanwhile
    ps.redis.exc = None
    ps._save_broadcast_positions()
    assert ps.redis.written == [{0: 9, 1: 7}] and ps._broadcast_positions == {}
    ps.redis.exc = redis.ResponseError("WRONGTYPE Operation against a key")
    ps._broadcast_positions = {2: 1}
    with pytest.raises(redis.ResponseError):
        ps._save_broadcast_positions()
