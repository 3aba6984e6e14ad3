"""Shared fixtures: a real Kafka broker and Redis server for the whole session (each
pytest-xdist worker's session: ``make test`` runs two, each with a stack of its own).

Picked in this order: ``KAFKA_BOOTSTRAP_SERVERS``/``REDIS_URL``; testcontainers when a Docker
engine answers; the embedded stack (Tansu + Valkey from PyPI wheels). Each test gets its own
topic prefix, so tests never see each other's records.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka.admin import AdminClient

from freshcore.kafka import admin_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import catalogue_with, ensure_topics
from freshrec.app.stack import EmbeddedStack

TEST_PARTITIONS = 4
EMBEDDED_SESSION_TIMEOUT_MS = 3000
"""The tests' consumer-group session on the embedded broker, half the ``local`` profile's 6 s:
a group join there takes about half of the session, and the suite joins groups a few hundred
times (the embedded broker accepts any session)."""
BROKER_SESSION_TIMEOUT_MS = 6000
"""On any other broker (testcontainers' Apache Kafka, an external one): the least Apache
Kafka's ``group.min.session.timeout.ms`` accepts by default."""


def _use_session_timeout(ms: int) -> int:
    """The session every consumer group of the tests uses; processes the tests start get it
    through the environment."""
    os.environ["FRESHREC_KAFKA_SESSION_TIMEOUT_MS"] = str(ms)
    return ms


SESSION_TIMEOUT_MS = _use_session_timeout(EMBEDDED_SESSION_TIMEOUT_MS)


@dataclass(frozen=True)
class Services:
    kind: str
    kafka_bootstrap_servers: str
    redis_url: str

    @property
    def session_timeout_ms(self) -> int:
        embedded = self.kind.startswith("embedded")
        return EMBEDDED_SESSION_TIMEOUT_MS if embedded else BROKER_SESSION_TIMEOUT_MS

    def conn(self, prefix: str = "") -> ConnectionSettings:
        return ConnectionSettings(
            self.kafka_bootstrap_servers,
            self.redis_url,
            prefix,
            "local",
            kafka_session_timeout_ms=self.session_timeout_ms,
        )


def _docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Iterator[Services]:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") and os.environ.get("REDIS_URL"):
        s = Services("external", os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"])
        _use_session_timeout(s.session_timeout_ms)
        yield s
        return
    if _docker_engine_answers():
        from testcontainers.kafka import KafkaContainer
        from testcontainers.redis import RedisContainer

        with KafkaContainer().with_kraft() as kafka, RedisContainer() as redis_c:
            url = f"redis://{redis_c.get_container_host_ip()}:{redis_c.get_exposed_port(6379)}/0"
            s = Services("testcontainers", kafka.get_bootstrap_server(), url)
            _use_session_timeout(s.session_timeout_ms)
            yield s
        return
    stack = EmbeddedStack(tmp_path_factory.mktemp("stack"))
    state = stack.up(detach=False)
    try:
        yield Services("embedded", state.env["KAFKA_BOOTSTRAP_SERVERS"], state.env["REDIS_URL"])
    finally:
        stack.down()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


def _provisioned(services: Services, prefix: str) -> ConnectionSettings:
    c = services.conn(prefix)
    specs = catalogue_with(
        {name: TEST_PARTITIONS for name in ("events", "recommend.requests", "gradients")}
    )
    ensure_topics(AdminClient(admin_config(c)), prefix, specs)
    return c


@pytest.fixture
def conn(services: Services, prefix: str) -> ConnectionSettings:
    """Connection settings with this test's own topic prefix; topics provisioned."""
    return _provisioned(services, prefix)


@pytest.fixture(scope="session")
def cluster_services(tmp_path_factory) -> Iterator[Services]:
    """An embedded stack whose Redis is a Redis Cluster of three masters (``freshrec stack up
    --redis-cluster 3``), for the tests that must hold on a cluster too."""
    stack = EmbeddedStack(tmp_path_factory.mktemp("cluster-stack"))
    state = stack.up(detach=False, redis_cluster=3)
    try:
        yield Services(
            "embedded-cluster", state.env["KAFKA_BOOTSTRAP_SERVERS"], state.env["REDIS_URL"]
        )
    finally:
        stack.down()


@pytest.fixture
def cluster_conn(cluster_services: Services, prefix: str) -> ConnectionSettings:
    """``conn`` on the cluster stack."""
    return _provisioned(cluster_services, prefix)


@pytest.fixture(params=["redis", "cluster"])
def any_conn(request) -> ConnectionSettings:
    """``conn`` on a single Redis server, then on a Redis Cluster."""
    return request.getfixturevalue("conn" if request.param == "redis" else "cluster_conn")


@pytest.fixture
def redis_client(services: Services):
    import redis

    client = redis.Redis.from_url(services.redis_url)
    yield client
    client.close()


def wait_for(
    condition: Callable[[], object], timeout_s: float = 20.0, interval_s: float = 0.05, what=""
):
    """Poll ``condition`` until truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what or condition}")
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Ranking models and starting rows of the serving tests' small world, trained once."""
    from .serving_harness import train_models

    d = tmp_path_factory.mktemp("models")
    train_models(d)
    return d


@pytest.fixture
def seeded(conn, model_dir):
    """``conn`` with the small world's rows, catalogue and a hot list in Redis."""
    from .serving_harness import seed_redis

    seed_redis(conn, model_dir)
    return conn
