"""A service or command started with no Kafka broker answering says so in one line and exits
with status 2 (``freshcore.topics.metadata``; ``RecommendClient.start`` raises the same error),
instead of a traceback and, from the admin clients, a raw line to stderr for every refused
connection."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from freshcore.kafka import CLIENT_LOG, admin_config, partition_count, producer_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import BrokerUnreachable, ensure_topics, metadata
from freshrec.app.stack import free_port
from freshrec.client import RecommendClient
from schemas.errors import FreshRecError


def nowhere() -> ConnectionSettings:
    """Connection settings naming a port nothing listens on."""
    return ConnectionSettings(kafka_bootstrap_servers=f"127.0.0.1:{free_port()}", redis_url="")


def _nothing_there(tmp_path) -> dict[str, str]:
    """The environment of a ``freshrec`` process with Kafka and Redis at ports nothing
    listens on."""
    return dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        FRESHREC_METRICS_PORT="0",
        FRESHREC_HOME=str(tmp_path),
    )


def _freshrec_with_nothing_there(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``freshrec ARGS`` with Kafka and Redis at ports nothing listens on."""
    return subprocess.run(
        [sys.executable, "-m", "freshrec.app.cli", *args],
        env=_nothing_there(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_metadata_from_no_broker_is_a_freshrec_error_that_says_what_to_check(caplog):
    caplog.set_level(logging.INFO, logger=CLIENT_LOG.name)
    admin = AdminClient(admin_config(nowhere()))
    with pytest.raises(BrokerUnreachable) as raised:
        metadata(admin, 1.0)
    assert isinstance(raised.value, FreshRecError) and raised.value.retriable
    text = str(raised.value)
    assert "no Kafka broker answered within 1 s" in text
    assert "KAFKA_BOOTSTRAP_SERVERS" in text
    # the admin client's own line about why went through Python's logging
    assert any("Connection refused" in r.getMessage() for r in caplog.records), caplog.text


def test_partition_count_and_topic_creation_raise_it_too():
    producer = Producer(producer_config(nowhere()))
    with pytest.raises(BrokerUnreachable):
        partition_count(producer, "events", timeout_s=1.0)
    with pytest.raises(BrokerUnreachable):
        ensure_topics(AdminClient(admin_config(nowhere())), timeout_s=1.0)


@pytest.mark.parametrize("service", ["worker", "streams"])
def test_a_service_started_without_a_broker_exits_2_with_one_clear_line(tmp_path, service):
    done = _freshrec_with_nothing_there(tmp_path, service)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "freshrec: error: no Kafka broker answered within" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    # librdkafka's own lines only through logging, repeats held: no raw "%3|" lines
    raw = [line for line in done.stderr.splitlines() if line.startswith("%")]
    assert not raw, raw[:3]


@pytest.mark.parametrize("service", ["worker", "streams"])
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_service_told_to_stop_while_its_broker_is_away_stops_at_once(tmp_path, stop, service):
    """The metadata wait (15 s) no longer holds the signal handler back: the service stops
    with status 0, as it does when stopped once running, not with status 2 when the wait
    runs out (nor, the streams app, with an interrupted command's 130)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "freshrec.app.cli", service],
        env=_nothing_there(tmp_path),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in proc.stderr:  # ends at the process's exit if the line never comes
            seen.append(line)
            if "no Kafka broker answered yet" in line:
                proc.send_signal(stop)
                break
        proc.wait(timeout=60)
        seen.append(proc.stderr.read())  # communicate() would skip what the loop buffered
    finally:
        proc.kill()
    text = "".join(seen)
    assert proc.returncode == 0, text[-3000:]
    assert "asked to stop while waiting for the Kafka broker" in text, text[-3000:]
    assert "Traceback" not in text and "freshrec: error" not in text, text[-3000:]


def test_the_recommend_client_with_no_broker_raises_it_and_closes_what_it_opened():
    client = RecommendClient(f"127.0.0.1:{free_port()}")
    with pytest.raises(BrokerUnreachable, match=r"no Kafka broker answered at 127\.0\.0\.1:"):
        asyncio.run(client.start())
    assert client._producer is None and client._consumer is None


def test_freshrec_recommend_with_no_broker_exits_2_with_one_clear_line(tmp_path):
    done = _freshrec_with_nothing_there(tmp_path, "recommend", "--user", "u1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "freshrec: error: no Kafka broker answered at" in done.stderr
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr, done.stderr[-3000:]
