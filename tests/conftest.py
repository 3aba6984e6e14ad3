"""Shared fixtures: a real Kafka broker and Redis server for the whole session (each
pytest-xdist worker's session: ``make test`` runs two, each with a stack of its own).

Picked in this order: ``KAFKA_BOOTSTRAP_SERVERS``/``REDIS_URL``; testcontainers when a Docker
engine answers; the embedded stack, whose broker is picked as ``freshrec stack up`` picks it
(``FRESHREC_BROKER``, by default Apache Kafka where Java 17+ runs it and its jars are fetched
— ``make test`` fetches them, a test never does — else Tansu). The session's header says
which broker and why. Tests marked ``tansu`` (the smoke set: the stack, produce/consume,
request/reply, the closed loop) run once more against an embedded Tansu stack when the
session's broker is not Tansu, so the path without Java stays tested. Each test gets its own
topic prefix, so tests never see each other's records; its topics are deleted after it.
"""

from __future__ import annotations

import contextlib
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
from freshrec.app.settings import BROKER
from freshrec.app.stack import EmbeddedStack, choose_broker

TEST_PARTITIONS = 4
TANSU_SESSION_TIMEOUT_MS = 3000
"""The tests' consumer-group session on Tansu, half the ``tansu`` profile's 6 s: a group join
there takes about half of the session, and the suite joins groups a few hundred times (Tansu
accepts any session)."""
KAFKA_SESSION_TIMEOUT_MS = 6000
"""On Apache Kafka (the local stack, testcontainers' or an external one): the ``kafka``
profile's, the least Apache Kafka's ``group.min.session.timeout.ms`` accepts by default."""


def _docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


LOCAL_BROKER = choose_broker(BROKER.read(os.environ), may_fetch=False)
"""The broker an embedded stack of this session runs: its own, and the stacks tests start."""
if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") and os.environ.get("REDIS_URL"):
    MAIN = "external"
elif _docker_engine_answers():
    MAIN = "testcontainers"
else:
    MAIN = LOCAL_BROKER.kind
"""The session's services: ``external``, ``testcontainers``, ``kafka`` or ``tansu`` (the
embedded stack's broker)."""


@dataclass(frozen=True)
class Services:
    kind: str
    """``external``, ``testcontainers`` or ``embedded``."""
    kafka_bootstrap_servers: str
    redis_url: str
    broker: str = "kafka"
    """``kafka`` (Apache Kafka, whatever runs it) or ``tansu``: the client profile of that
    name, and the session that suits it."""

    @property
    def session_timeout_ms(self) -> int:
        return TANSU_SESSION_TIMEOUT_MS if self.broker == "tansu" else KAFKA_SESSION_TIMEOUT_MS

    def conn(self, prefix: str = "") -> ConnectionSettings:
        return ConnectionSettings(
            self.kafka_bootstrap_servers,
            self.redis_url,
            prefix,
            self.broker,
            kafka_session_timeout_ms=self.session_timeout_ms,
        )


def _use_timings(broker: str) -> int:
    """The client profile and session every consumer group of the tests uses; processes the
    tests start get them through the environment. Returns the session."""
    session = Services("", "", "", broker).session_timeout_ms
    os.environ["FRESHREC_KAFKA_PROFILE"] = broker
    os.environ["FRESHREC_KAFKA_SESSION_TIMEOUT_MS"] = str(session)
    return session


SESSION_TIMEOUT_MS = _use_timings("tansu" if MAIN == "tansu" else "kafka")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "tansu: also run against an embedded Tansu stack (the smoke set of the path without "
        "Java) when the session's broker is another",
    )


def pytest_report_header(config) -> list[str]:
    if MAIN == "external":
        line = f"broker: external, KAFKA_BOOTSTRAP_SERVERS={os.environ['KAFKA_BOOTSTRAP_SERVERS']}"
    elif MAIN == "testcontainers":
        line = "broker: Apache Kafka in testcontainers (a Docker engine answers)"
    else:
        line = LOCAL_BROKER.line
    smoke = "; tests marked tansu run on Tansu too" if MAIN != "tansu" else ""
    return [line + smoke]


def pytest_generate_tests(metafunc) -> None:
    """A ``tansu``-marked test that takes ``broker`` runs on the session's broker and on
    Tansu."""
    if (
        MAIN != "tansu"
        and "broker" in metafunc.fixturenames
        and metafunc.definition.get_closest_marker("tansu")
    ):
        metafunc.parametrize("broker", ["main", "tansu"], ids=[MAIN, "tansu"], indirect=True)


@pytest.fixture
def broker(request) -> str:
    """The broker this test runs on: ``tansu`` in a smoke test's Tansu run, else the
    session's (``external``, ``testcontainers``, ``kafka`` or ``tansu``). A test that starts
    a stack of its own passes ``stack_broker(broker)`` to it."""
    return "tansu" if getattr(request, "param", "main") == "tansu" else MAIN


def stack_broker(broker: str) -> str | None:
    """What a test's own stack runs for ``broker``: that broker, or (the session's services
    not being a stack) the one ``FRESHREC_BROKER`` picks."""
    return broker if broker in ("kafka", "tansu") else None


@contextlib.contextmanager
def embedded_services(tmp_path_factory, name: str, **up) -> Iterator[Services]:
    """An embedded stack for the session, stopped after it."""
    stack = EmbeddedStack(tmp_path_factory.mktemp(name))
    state = stack.up(detach=False, **up)
    try:
        yield Services(
            "embedded", state.env["KAFKA_BOOTSTRAP_SERVERS"], state.env["REDIS_URL"], state.broker
        )
    finally:
        stack.down()


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Iterator[Services]:
    if MAIN == "external":
        yield Services("external", os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"])
        return
    if MAIN == "testcontainers":
        from testcontainers.kafka import KafkaContainer
        from testcontainers.redis import RedisContainer

        with KafkaContainer().with_kraft() as kafka, RedisContainer() as redis_c:
            url = f"redis://{redis_c.get_container_host_ip()}:{redis_c.get_exposed_port(6379)}/0"
            yield Services("testcontainers", kafka.get_bootstrap_server(), url)
        return
    with embedded_services(tmp_path_factory, "stack", broker=LOCAL_BROKER) as s:
        yield s


@pytest.fixture(scope="session")
def tansu_services(tmp_path_factory) -> Iterator[Services]:
    """An embedded Tansu stack, for the smoke set's second run."""
    with embedded_services(tmp_path_factory, "tansu-stack", broker="tansu") as s:
        yield s


@pytest.fixture
def broker_services(broker: str, request) -> Services:
    """The session's services, or Tansu's in a smoke test's Tansu run."""
    name = "tansu_services" if broker == "tansu" and MAIN != "tansu" else "services"
    return request.getfixturevalue(name)


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


def delete_topics(conn: ConnectionSettings) -> None:
    """Every topic under the connection's prefix, deleted: Apache Kafka keeps each
    partition's files open, and a session's tests create some ten thousand partitions."""
    admin = AdminClient(admin_config(conn))
    with contextlib.suppress(Exception):  # a broker stopped by the test has nothing to delete
        names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(conn.topic_prefix)]
        if names:
            for future in admin.delete_topics(names, operation_timeout=10).values():
                with contextlib.suppress(Exception):
                    future.result()


@pytest.fixture
def conn(broker_services: Services, prefix: str) -> Iterator[ConnectionSettings]:
    """Connection settings with this test's own topic prefix; topics provisioned, and
    deleted after the test."""
    c = _provisioned(broker_services, prefix)
    yield c
    delete_topics(c)


@pytest.fixture(scope="session")
def cluster_services(tmp_path_factory) -> Iterator[Services]:
    """An embedded stack whose Redis is a Redis Cluster of three masters (``freshrec stack up
    --redis-cluster 3``), for the tests that must hold on a cluster too."""
    with embedded_services(
        tmp_path_factory, "cluster-stack", broker=LOCAL_BROKER, redis_cluster=3
    ) as s:
        yield s


@pytest.fixture
def cluster_conn(cluster_services: Services, prefix: str) -> Iterator[ConnectionSettings]:
    """``conn`` on the cluster stack."""
    c = _provisioned(cluster_services, prefix)
    yield c
    delete_topics(c)


@pytest.fixture(params=["redis", "cluster"])
def any_conn(request) -> ConnectionSettings:
    """``conn`` on a single Redis server, then on a Redis Cluster."""
    return request.getfixturevalue("conn" if request.param == "redis" else "cluster_conn")


@pytest.fixture
def redis_client(broker_services: Services):
    import redis

    client = redis.Redis.from_url(broker_services.redis_url)
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
