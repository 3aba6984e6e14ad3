"""Repeated log lines once per window (``freshcore/logrepeat.py``), and librdkafka's lines about
a broker that does not answer held to that."""

from __future__ import annotations

import logging

from confluent_kafka import Producer

from freshcore.kafka import CLIENT_LOG, CLIENT_LOG_REPEATS, producer_config
from freshcore.logrepeat import RepeatFilter, kind_of
from freshcore.settings import ConnectionSettings
from freshrec.app.stack import free_port

from .streams_harness import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(text: str, name: str = "client", *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, text, args, None)


REFUSED = "127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed: Connection refused"


def test_a_line_repeated_within_the_window_is_held_back_and_counted_by_the_next_one_through():
    clock = Clock()
    f = RepeatFilter(30, clock=clock)
    first = record(REFUSED + " (after 0ms in state CONNECT)")
    assert f.filter(first) and first.getMessage().endswith("(after 0ms in state CONNECT)")
    for ms in range(1, 41):  # the same failure, told 40 more times within the window
        clock.now = ms * 0.05
        assert not f.filter(record(REFUSED + f" (after {ms}ms in state CONNECT)"))
    assert f.held_back("client", REFUSED) == 40
    clock.now = 30.0
    through = record(REFUSED + " (after 0ms in state CONNECT)")
    assert f.filter(through)
    assert through.getMessage().endswith("(and 40 more like it in the last 30 s)")
    assert f.held_back("client", REFUSED) == 0
    clock.now = 59.9
    assert not f.filter(record(REFUSED))  # a new window opened at 30 s


def test_kinds_are_told_apart_by_logger_and_text_but_not_by_what_varies_between_attempts():
    f = RepeatFilter(30, clock=Clock())
    assert f.filter(record(REFUSED, "a"))
    assert f.filter(record(REFUSED, "b"))  # another client
    assert f.filter(record(REFUSED.replace(":9", ":10")))  # another broker
    assert f.filter(record("Unable connect to node with id %s", "client", 111))
    assert not f.filter(record("Unable connect to node with id %s", "client", 111))
    assert f.filter(record("Unable connect to node with id %s", "client", 112))
    assert kind_of("session timed out after 3002ms") == kind_of("session timed out after 3005ms")


def test_the_kinds_remembered_are_bounded_and_a_forgotten_kind_is_new_again():
    f = RepeatFilter(30, clock=Clock(), max_kinds=3)
    for i in range(10):
        assert f.filter(record(f"line {i}"))
    assert len(f._kinds) == 3
    assert f.filter(record("line 0"))  # forgotten: through again
    assert not f.filter(record("line 9"))  # remembered: held


def test_a_producer_with_no_broker_says_so_once_a_window_through_python_logging(caplog):
    port = free_port()  # nothing listens there
    conn = ConnectionSettings(kafka_bootstrap_servers=f"127.0.0.1:{port}", redis_url="")
    producer = Producer(producer_config(conn))
    refused = f"127.0.0.1:{port}/bootstrap: Connect to ipv4#127.0.0.1:{port} failed: "
    refused += "Connection refused"
    caplog.set_level(logging.INFO, logger=CLIENT_LOG.name)

    def told() -> list[logging.LogRecord]:
        producer.poll(0.05)  # librdkafka's lines reach Python when the client is polled
        return [
            r for r in caplog.records if r.name == CLIENT_LOG.name and refused in r.getMessage()
        ]

    wait_for(lambda: bool(told()), 30, "a refused connection logged")
    line = told()[0].getMessage()
    wait_for(
        lambda: bool(told()) and CLIENT_LOG_REPEATS.held_back(CLIENT_LOG.name, line) >= 5,
        30,
        "five more refused connections held back",
    )
    assert len(told()) == 1, [r.getMessage() for r in told()]
