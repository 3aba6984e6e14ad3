"""The deployment's secure Kafka, run for real: Apache Kafka with the listeners, SCRAM users and
authorizer of ``deploy/kafka/start.sh`` (docker-compose's broker), its client listener on
TLS with a CA made for the run, and the ACLs ``freshrec topics create --acls`` grants, run as
compose's ``topic-init`` runs it. Each FreshRec service runs as compose runs it, logged in
as its own user, and does its work with its own grants only; the client may do what its
grants say and the broker refuses it the rest; a wrong password and a connection without
SASL are refused; and no password reaches a log line.

Needs Java 17 or newer, Apache Kafka's jars (``freshrec stack fetch``) and openssl; skips
saying which is missing. The broker listens on loopback only, on free ports, and is stopped
(with every service) when the module ends.
"""

from __future__ import annotations

import gc
import logging
import re
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from freshcore.kafka import close_producer, producer_config
from freshcore.rediskeys import RedisKeys
from freshcore.topics import CATALOGUE
from freshrec.acls import ADMIN, DEPLOYED_AS, SERVICES, allows, service_acls
from freshrec.app.stack import pid_alive
from schemas.codec import encode_event, encode_item
from schemas.records import Event, Item

from . import secure_probes as probes
from .conftest import wait_for
from .secure_broker import (
    BROKER_LISTENER,
    START_SH,
    SecureKafka,
    make_ca,
    scram_users,
    secure_kafka_or_why,
)
from .secure_deployment import COMPOSE, SERVICE_COMMANDS, SecureDeployment, compose_user

pytestmark = pytest.mark.timeout(900)
START_TIMEOUT_S = 240.0
"""Generous: the machine running the suite may be loaded many times over."""


# ------------------------------------------------------------------- one source of users
def test_the_brokers_users_are_the_principals_the_grants_are_written_for():
    """start.sh creates a SCRAM user for the admin and each principal of ``freshrec.acls``
    (and no other), each with its own password variable, which compose hands to the broker
    and which deploy/env.example lists; each FreshRec service compose runs logs in as the
    user ``DEPLOYED_AS`` names for its command, with that user's password (the Kubernetes
    manifests are held to the same table in test_kubernetes)."""
    users = scram_users(START_SH.read_text())
    assert set(users) == {ADMIN, *SERVICES}
    assert len(set(users.values())) == len(users)
    kafka_env = COMPOSE["services"]["kafka"]["environment"]
    example = (Path(START_SH).parents[1] / "env.example").read_text()
    for variable in users.values():
        assert kafka_env[variable] == f"${{{variable}:?set {variable}}}"
        assert f"\n{variable}=\n" in f"\n{example}"
    for name, service in COMPOSE["services"].items():
        if not service.get("build"):
            continue
        env = service["environment"]
        user = env["KAFKA_SASL_USERNAME"]
        assert user in users, f"{name} logs in as {user}, whom the broker does not know"
        assert user == DEPLOYED_AS[service["command"][0]], name
        assert env["KAFKA_SASL_PASSWORD"] == kafka_env[users[user]], name
    assert {compose_user(c) for c in SERVICE_COMMANDS} <= set(service_acls(""))


@pytest.mark.parametrize("prefix", ["", "probe."])
def test_the_worker_may_look_up_the_group_of_its_assign_only_consumer(prefix):
    """librdkafka asks for the coordinator of a consumer's group.id even when it only
    assigns partitions (the worker's broadcast reader): the worker may describe it."""
    from freshcore.kafka import consumer_config
    from freshcore.settings import ConnectionSettings

    group = consumer_config(ConnectionSettings("k:9092", "redis://r", prefix), None)["group.id"]
    assert allows(service_acls(prefix)["worker"], "group", group, "DESCRIBE")


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def captured_logs():
    """Every log record of this process while the module runs (its own clients': aiokafka,
    librdkafka through FreshRec's logger), formatted, at INFO and above."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    root, keep = logging.getLogger(), Keep(logging.INFO)
    level = root.level
    root.addHandler(keep)
    root.setLevel(min(level, logging.INFO))
    try:
        yield lines
    finally:
        root.removeHandler(keep)
        root.setLevel(level)


@pytest.fixture(scope="module")
def kafka(tmp_path_factory) -> SecureKafka:
    found = secure_kafka_or_why(tmp_path_factory.mktemp("secure-kafka"))
    if isinstance(found, str):
        pytest.skip(found)
    try:
        found.start(START_TIMEOUT_S)
        yield found
    finally:
        gc.collect()  # the probes' clients, so that none retries a stopped broker's port
        found.stop()
        assert found.proc is None or not pid_alive(found.proc.pid)


@pytest.fixture(scope="module")
def deployment(kafka, tmp_path_factory) -> SecureDeployment:
    """Topics and ACLs made as compose's topic-init makes them (its command, its user, over
    the broker's internal SASL_PLAINTEXT listener as on the compose network), and Redis."""
    d = SecureDeployment(kafka, tmp_path_factory.mktemp("secure-deployment"))
    init = COMPOSE["services"]["topic-init"]
    user = init["environment"]["KAFKA_SASL_USERNAME"]
    assert d.run("topic-init", user, *init["command"], listener=BROKER_LISTENER) == 0, d.logs()
    with d.redis():
        yield d


@pytest.fixture(scope="module")
def services(deployment) -> SecureDeployment:
    """The streams app, the parameter server and a worker, each run as compose runs it."""
    for command in SERVICE_COMMANDS:
        deployment.start(command, compose_user(command), command)
    try:
        for command in SERVICE_COMMANDS:
            wait_for(
                lambda c=command: deployment.started(c),
                START_TIMEOUT_S,
                interval_s=0.2,
                what=f"`freshrec {command}` to log its start",
            )
        yield deployment
    finally:
        codes = deployment.stop()
        assert all(not pid_alive(p.pid) for p in deployment.procs.values()), codes


# --------------------------------------------------------------------------- the services
def _produce_world(d: SecureDeployment, n_users: int = 20) -> list[str]:
    """A small catalogue and clicks on it, produced as the client."""
    producer_conf = producer_config(d.conn("client"))
    from confluent_kafka import Producer

    producer = Producer(producer_conf)
    failed: list = []
    now = int(time.time() * 1000)
    items = [f"i{k}" for k in range(30)]
    for item in items:
        record = Item(item, f"c{len(item) % 4}", 9.5, now - 3_600_000)
        producer.produce("items", encode_item(record), item.encode(), on_delivery=_into(failed))
    users = [f"u{k}" for k in range(n_users)]
    for k, user in enumerate(users):
        for j in range(5):
            kind = "click" if j % 2 else "impression"
            event = Event(uuid.uuid4().hex, kind, user, items[(k + j) % len(items)], now + j)
            producer.produce(
                "events", encode_event(event), user.encode(), on_delivery=_into(failed)
            )
    assert close_producer(producer, 60) == 0
    assert not failed, failed
    return users


def _into(failed: list):
    return lambda err, msg: failed.append(err) if err is not None else None


def test_every_service_does_its_work_with_only_its_own_grants(services):
    """Events the client produces are counted by the streams app (a hot list in Redis), a
    worker answers the client's request on the reply topic, learns from the clicks and
    sends gradients, which the parameter server applies and broadcasts."""
    import redis

    from freshrec.client import RecommendTimeout, SyncRecommendClient

    d = services
    users = _produce_world(d)
    keys = RedisKeys("")
    r = redis.Redis.from_url(d.redis_url)
    wait_for(lambda: r.exists(keys.hot("global")), 180, what="the streams app's hot list")
    replies = []
    with SyncRecommendClient(
        d.kafka.bootstrap(), security=d.security("client"), profile="kafka", timeout_s=10
    ) as client:

        def served_from_the_hot_list():
            try:
                replies.append(client.recommend(users[0], k=5))
            except RecommendTimeout:  # no worker in the group yet
                return False
            return replies[-1].items  # empty until the worker has read the hot list

        wait_for(served_from_the_hot_list, 180, interval_s=1, what="a worker's reply")
    assert replies[-1].worker and replies[-1].tier == "hot", replies[-1]  # no ranking models

    def applied() -> bool:
        offsets = r.mget(r.keys("ps:applied:*")) if r.keys("ps:applied:*") else []
        return any(int(o) >= 0 for o in offsets if o is not None)

    wait_for(applied, 180, what="the parameter server to apply a worker's gradients")
    wait_for(lambda: r.exists(keys.ps_broadcast), 180, what="the parameter server's broadcast")
    logs = d.logs()
    for name in SERVICE_COMMANDS:
        refused = REFUSED_LINE.search(logs[name])
        assert refused is None, (name, refused and refused.group(0))


REFUSED_LINE = re.compile(
    r"authori[sz]ation[_ ]failed|authentication (error|failed)|SaslAuthenticationFailed", re.I
)
"""A log line that says the broker refused a login or an operation."""


# ------------------------------------------------------------------ each principal's grants
PROBE_PREFIX = "probe."
"""The catalogue once more under a prefix of its own, with the ACLs ``topics create --acls``
grants for it: probes write and delete there, never in the services' topics."""


@pytest.fixture(scope="module")
def decisions(deployment) -> dict[str, dict[tuple[str, str], bool]]:
    """What the broker let each principal do: (topic, operation) -> allowed, for WRITE and
    READ on every topic of the catalogue, CREATE of a reply topic of its own and of another
    topic, and DELETE of them all (last)."""
    init = COMPOSE["services"]["topic-init"]
    user = init["environment"]["KAFKA_SASL_USERNAME"]
    rc = deployment.run(
        "topic-init-probe",
        user,
        *init["command"],
        listener=BROKER_LISTENER,
        FRESHREC_TOPIC_PREFIX=PROBE_PREFIX,
    )
    assert rc == 0, deployment.logs()["topic-init-probe"]
    topics = [PROBE_PREFIX + spec.name for spec in CATALOGUE]
    found = {}
    for principal in SERVICES:
        config = deployment.kafka.client_config(principal)
        seen = {(t, "WRITE"): ok for t, ok in probes.writes(config, topics).items()}
        group = f"{PROBE_PREFIX}probe-{principal}"
        seen |= {(t, "READ"): ok for t, ok in probes.reads(config, topics, group).items()}
        new = [
            f"{PROBE_PREFIX}recommend.replies.{principal}-1",
            f"{PROBE_PREFIX}events.{principal}",
        ]
        made = probes.creates(config, new)
        seen |= {(t, "CREATE"): ok for t, ok in made.items()}
        gone = probes.deletes(config, [*topics, *(t for t in new if made[t])])
        seen |= {(t, "DELETE"): ok for t, ok in gone.items()}
        found[principal] = seen
    return found


@pytest.mark.parametrize("principal", SERVICES)
def test_the_broker_allows_each_principal_what_its_grants_say_and_refuses_the_rest(
    decisions, principal
):
    grants = service_acls(PROBE_PREFIX)[principal]
    seen = decisions[principal]
    expected = {(t, op): allows(grants, "topic", t, op) for t, op in seen}
    wrong = {k: v for k, v in seen.items() if v != expected[k]}
    assert not wrong, f"the broker's answer differs from the grants' (allowed?): {wrong}"
    assert any(seen.values()) and not all(seen.values())


def test_the_client_asks_and_reads_replies_and_may_touch_nothing_else(decisions, deployment):
    """The client writes requests (and events: the event producers log in as the client)
    and reads the reply topics; the broker refuses it, with an authorization error, the
    deletion of the shared reply topic, events and gradients, a write to the replies,
    gradients, the broadcast or the serving mode, a read of anything but replies, and the
    workers' consumer group."""
    seen = {(t.removeprefix(PROBE_PREFIX), op): ok for (t, op), ok in decisions["client"].items()}
    assert seen["recommend.requests", "WRITE"] and seen["recommend.replies", "READ"]
    assert seen["recommend.replies.client-1", "CREATE"]
    assert seen["recommend.replies.client-1", "DELETE"]
    for topic in ("recommend.replies", "events", "gradients", "recommend.requests"):
        assert not seen[topic, "DELETE"], topic
    for topic in ("recommend.replies", "gradients", "embeddings.updates", "control"):
        assert not seen[topic, "WRITE"], topic
    for topic in ("events", "gradients", "recommend.requests", "embeddings.updates"):
        assert not seen[topic, "READ"], topic
    assert not seen["events.client", "CREATE"]
    config = deployment.kafka.client_config("client")
    assert probes.joins(
        config, f"{PROBE_PREFIX}freshrec-workers", PROBE_PREFIX + "recommend.replies"
    ) == (KafkaError.GROUP_AUTHORIZATION_FAILED)


# ------------------------------------------------------------------------ who may log in
def _login(kafka: SecureKafka, how: str) -> dict:
    ca = {"ssl.ca.location": str(kafka.ca)}
    return {
        "with its own password": kafka.client_config("worker"),
        "with its own password, to the internal listener": kafka.client_config(
            "worker", BROKER_LISTENER
        ),
        "with a wrong password": kafka.client_config("worker", **{"sasl.password": "not-it"}),
        "as a user the broker does not know": kafka.client_config(
            "worker", **{"sasl.username": "nobody"}
        ),
        "in plaintext, no SASL, to the TLS listener": {
            "bootstrap.servers": kafka.bootstrap(),
            "security.protocol": "PLAINTEXT",
        },
        "in plaintext, no SASL, to the internal listener": {
            "bootstrap.servers": kafka.bootstrap(BROKER_LISTENER),
            "security.protocol": "PLAINTEXT",
        },
        "over TLS without SASL": {
            "bootstrap.servers": kafka.bootstrap(),
            "security.protocol": "SSL",
            **ca,
        },
        "trusting another CA": kafka.client_config(
            "worker", **{"ssl.ca.location": str(_other_ca(kafka))}
        ),
    }[how]


def _other_ca(kafka: SecureKafka) -> Path:
    other = kafka.home / "other-ca"
    return other / "ca.pem" if (other / "ca.pem").exists() else make_ca(other)


LOGINS = {
    "with its own password": None,
    "with its own password, to the internal listener": None,
    "with a wrong password": {KafkaError._AUTHENTICATION},
    "as a user the broker does not know": {KafkaError._AUTHENTICATION},
    "in plaintext, no SASL, to the TLS listener": {
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TRANSPORT,
    },
    "in plaintext, no SASL, to the internal listener": {
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TRANSPORT,
    },
    "over TLS without SASL": {KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._SSL},
    "trusting another CA": {KafkaError._SSL, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN},
}
"""How a client logs in, and the errors that say the broker refused it (None: let in)."""


@pytest.mark.parametrize("how", list(LOGINS))
def test_only_a_sasl_login_with_the_right_password_is_let_in(kafka, how):
    err = probes.first_error(_login(kafka, how))
    if LOGINS[how] is None:
        assert err is None, err
    else:
        assert err is not None and err.code() in LOGINS[how], err


def test_freshrec_refused_a_login_fails_and_names_no_password(deployment):
    """``freshrec topics create`` with a wrong password exits with an error, and the client
    raises ``BrokerUnreachable``; neither says the password."""
    from freshcore.settings import KafkaSecurity
    from freshcore.topics import BrokerUnreachable
    from freshrec.client import SyncRecommendClient

    wrong = deployment.wrong_password
    rc = deployment.run("wrong-password", ADMIN, "topics", "create", KAFKA_SASL_PASSWORD=wrong)
    assert rc != 0
    text = deployment.logs()["wrong-password"]
    assert "SASL authentication error" in text and wrong not in text, text
    env = {**deployment.kafka.security_env("client"), "KAFKA_SASL_PASSWORD": wrong}
    with pytest.raises(BrokerUnreachable) as info:
        SyncRecommendClient(
            deployment.kafka.bootstrap(), security=KafkaSecurity.from_env(env), profile="kafka"
        )
    assert wrong not in str(info.value)


# ------------------------------------------------------------------------------- secrets
def test_no_password_reaches_a_log_line(services, captured_logs):
    """Every log this module made: each FreshRec service's, the topic and ACL runs', the
    refused logins', the broker's, and the test process's own records (its clients'). The
    secrets: every Kafka user's password, Redis's, and the wrong one tried."""
    logs = services.logs()
    assert "worker" in logs and "freshrec.worker" in logs["worker"]  # something to search
    logs["this test"] = "\n".join(captured_logs)
    for secret in services.secrets:
        for name, text in logs.items():
            assert secret not in text, f"a password in {name}'s log"
