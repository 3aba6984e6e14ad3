"""Who may do what on the broker: one Kafka principal per FreshRec service, and the ACLs that
let each do its job and nothing more. Pure (the table); ``apply_acls`` writes it through an
admin client.

The rule the table keeps: a service writes only the topics it owns and reads only its
inputs. Workers may write replies, gradients and their dead letters, never ``events``;
clients may write requests and events, read the reply topics, and create and delete their
own (``recommend.replies.<client id>``), never the shared ``recommend.replies``; nobody but
the parameter servers writes ``embeddings.updates``; no service writes ``control`` (the
serving mode: ``freshrec mode set`` as the admin, or a principal the deployment grants
WRITE on it). Consumer groups are granted by name or prefix, as each service names its
groups ``{prefix}freshrec-<service>…``. ``tests/test_kafka_secure.py`` holds a real broker
to this table.

>>> [g for g in service_acls("")["worker"] if g.operation == "WRITE" and g.name == "events"]
[]
>>> Grant("client", "topic", "recommend.replies", "READ", prefixed=True) in service_acls("")["client"]
True
>>> allows(service_acls("")["client"], "topic", "recommend.replies", "DELETE")
False
>>> allows(service_acls("")["client"], "topic", "recommend.replies.c1", "DELETE")
True
"""

from __future__ import annotations

from dataclasses import dataclass

SERVICES = ("streams", "worker", "param-server", "client")
"""The principals (``User:<name>``): each service's own Kafka user."""
UNJOINED_GROUP = "freshrec-unjoined"
"""The ``group.id`` of FreshRec's consumers that only ``assign()`` (``freshcore.kafka``)."""
ADMIN = "admin"
"""The broker's super user: it creates the topics and grants the ACLs (``freshrec topics
create --acls``), and the brokers talk to each other as it."""
DEPLOYED_AS = {
    "streams": "streams",
    "param-server": "param-server",
    "worker": "worker",
    "train": "client",
    "topics": ADMIN,
}
"""The principal each ``freshrec`` command logs in as where FreshRec is deployed
(docker-compose's ``KAFKA_SASL_USERNAME``, the Kubernetes Deployment's Secret); the tests
hold both to it."""


@dataclass(frozen=True)
class Grant:
    principal: str
    resource: str
    """``topic`` or ``group``."""
    name: str
    operation: str
    """``READ``, ``WRITE``, ``DESCRIBE``, ``CREATE``, ``DELETE``."""
    prefixed: bool = False
    """The name is a prefix (every topic or group that starts with it)."""


def _topics(who: str, prefix: str, ops: str, *names: str, prefixed: bool = False) -> list[Grant]:
    return [
        Grant(who, "topic", prefix + name, op, prefixed)
        for name in names
        for op in (*ops.split(","), "DESCRIBE")
        if op
    ]


def service_acls(prefix: str = "") -> dict[str, list[Grant]]:
    """Every service's grants for a deployment whose topics and groups carry ``prefix``."""
    acl = {
        "streams": [
            *_topics("streams", prefix, "READ", "events", "items"),
            *_topics("streams", prefix, "READ,WRITE", "events.by_item"),
            *_topics("streams", prefix, "WRITE", "events.dlq"),
            Grant("streams", "group", f"{prefix}freshrec-streams", "READ", prefixed=True),
        ],
        "worker": [
            *_topics(
                "worker",
                prefix,
                "READ",
                "events",
                "recommend.requests",
                "embeddings.updates",
                "control",
            ),
            *_topics("worker", prefix, "WRITE", "gradients", "recommend.requests.dlq"),
            # the shared reply topic and every client's own (recommend.replies.<client id>)
            *_topics("worker", prefix, "WRITE", "recommend.replies", prefixed=True),
            Grant("worker", "group", f"{prefix}freshrec-workers", "READ"),
            # the group.id librdkafka needs on the broadcast's assign()-only consumer
            # (freshcore.kafka.consumer_config): never joined, but its coordinator is looked
            # up, which the broker refuses without DESCRIBE (a GROUP_AUTHORIZATION_FAILED
            # in the worker's log)
            Grant("worker", "group", UNJOINED_GROUP, "DESCRIBE"),
        ],
        "param-server": [
            *_topics("param-server", prefix, "READ", "gradients"),
            *_topics("param-server", prefix, "WRITE", "embeddings.updates"),
            Grant("param-server", "group", f"{prefix}freshrec-param-server", "READ"),
        ],
        "client": [
            *_topics("client", prefix, "WRITE", "recommend.requests", "events", "items"),
            # the shared reply topic and its own; it creates and deletes only its own
            # (recommend.replies.<client id>), never the shared one the other clients read
            *_topics("client", prefix, "READ", "recommend.replies", prefixed=True),
            *_topics("client", prefix, "CREATE,DELETE", "recommend.replies.", prefixed=True),
        ],
    }
    return acl


def allows(grants: list[Grant], resource: str, name: str, operation: str) -> bool:
    """Whether ``grants`` let their principal do ``operation`` on the ``resource`` (``topic``
    or ``group``) called ``name``, as the broker's authorizer reads them: a literal grant
    names it, a prefixed one starts it. (Kafka also lets READ, WRITE and DELETE imply
    DESCRIBE; the table grants DESCRIBE beside each, so it is not implied here.)"""
    return any(
        g.resource == resource
        and g.operation == operation
        and (name.startswith(g.name) if g.prefixed else name == g.name)
        for g in grants
    )


def apply_acls(admin, prefix: str = "", timeout_s: float = 30.0) -> int:
    """Create every grant of ``service_acls`` (ALLOW, any host) with a confluent-kafka
    ``AdminClient`` of a principal that may alter ACLs; idempotent. Returns how many, once
    the broker that answers lists them all (``in_force``).

    Grants already on the broker that the table no longer has are left there: remove them
    with ``kafka-acls.sh --remove``."""
    bindings = _bindings(service_acls(prefix))
    for future in admin.create_acls(bindings).values():
        future.result(timeout_s)
    in_force(admin, bindings, timeout_s)
    return len(bindings)


def in_force(admin, bindings: list, timeout_s: float) -> None:
    """Wait until the broker lists every binding. ``create_acls`` answers once the KRaft
    controller has written them; a broker enforces them only once it has read them from
    the metadata log, and a service that started in between was refused (a probe of the
    streams user's writes, run straight after ``topics create --acls``, was)."""
    import time

    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    every = AclBindingFilter(
        ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
        AclPermissionType.ANY,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        listed = set(admin.describe_acls(every).result(timeout_s))
        missing = [b for b in bindings if b not in listed]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(missing)} of {len(bindings)} ACLs still not listed by the broker after "
                f"{timeout_s:g} s (first: {missing[0]})"
            )
        time.sleep(0.1)


def _bindings(acls: dict[str, list[Grant]]) -> list:
    """The table as confluent-kafka ``AclBinding`` s: ALLOW, from any host."""
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return [
        AclBinding(
            ResourceType.TOPIC if g.resource == "topic" else ResourceType.GROUP,
            g.name,
            ResourcePatternType.PREFIXED if g.prefixed else ResourcePatternType.LITERAL,
            f"User:{g.principal}",
            "*",
            AclOperation[g.operation],
            AclPermissionType.ALLOW,
        )
        for grants in acls.values()
        for g in grants
    ]
