"""Settings read from the environment at the edge, never deeper.

Every command builds its frozen settings object once, from ``load_environment()``: the process
environment layered over ``.freshrec/stack.env`` (written by ``freshrec stack up``). An
explicitly set variable always wins over the stack file, so ``KAFKA_BOOTSTRAP_SERVERS`` /
``REDIS_URL`` point everything at existing services.

>>> env = {"FRESHREC_TOPIC_PREFIX": "dev.", "KAFKA_BOOTSTRAP_SERVERS": "k:9092"}
>>> ConnectionSettings.from_env(env).topic_prefix
'dev.'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from freshcore.declare import (
    Setting,
    SettingsError,
    declaration,
    declared,
    declared_as,
    read_settings,
)
from freshcore.hotscore import HotWeights
from schemas.codec import DeadLetterLimits

STACK_ENV_FILE = "stack.env"


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Every process's log lines (the CLI's and the children services start)."""


__all__ = ["SettingsError"]  # raised here for every service; declared in freshcore.declare

HOME = Setting(
    "FRESHREC_HOME",
    None,
    "Where the embedded stack keeps PIDs, logs and `stack.env`, and the streams app its faust "
    "data directory (`faust/`).",
    kind=Path,
    shown="`./.freshrec`",
)
MODEL_DIR = Setting(
    "FRESHREC_MODEL_DIR",
    None,
    "Trained models and starting embeddings (`freshrec train`), read by every service.",
    kind=Path,
    shown="`models` in `FRESHREC_HOME`",
)


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the embedded stack keeps its state (``$FRESHREC_HOME`` or ``./.freshrec``)."""
    env = os.environ if env is None else env
    return HOME.read(env) or Path.cwd() / ".freshrec"


LEARNING_RATE = 0.05
"""The step size of item rows, locally in the worker and globally in the parameter server's
Adagrad, unless a model's manifest or a setting says otherwise. Chosen by
``tools/bench_freshness.py``: a closed-loop cohort's CTR rose from ~5% to 20-30% in two
minutes at 0.05-0.2, not at all at the seeds' 0.001 or at 0.01, and less at 0.5-1.0
(docs/online-learning.md)."""


def model_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the ranking models and their manifest live: ``FRESHREC_MODEL_DIR``, else
    ``models`` in the state directory. Every service finds them the same way."""
    env = os.environ if env is None else env
    return MODEL_DIR.read(env) or state_dir(env) / "models"


def online_defaults(env: Mapping[str, str] | None = None) -> dict:
    """What the models in ``model_dir(env)`` recommend for online learning (their manifest's
    ``online``: the loss the starting rows were trained with and step sizes that suit it;
    ``freshrec train --log`` writes one); empty when there are none or the manifest cannot be
    read. Settings in the environment win. The worker and the parameter server both read it
    here, as plain JSON (the parameter server loads no model), so they cannot disagree."""
    import json

    try:
        manifest = json.loads((model_dir(env) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    online = manifest.get("online") if isinstance(manifest, dict) else None
    return dict(online) if isinstance(online, dict) else {}


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a ``KEY=value`` file; blank lines and ``#`` comments are ignored."""
    values: dict[str, str] = {}
    if not path.exists():
        return values
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"{path}:{lineno}: expected KEY=value, got {raw!r}")
        values[key.strip()] = value.strip()
    return values


def load_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment layered over ``.freshrec/stack.env`` (environment wins)."""
    base = dict(os.environ if base is None else base)
    merged = read_env_file(state_dir(base) / STACK_ENV_FILE)
    merged.update(base)
    return merged


SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
GROUP_PROTOCOLS = ("classic", "consumer")
"""librdkafka's ``group.protocol``: the classic rebalance protocol, or KIP-848's."""


def _upper_choice(choices: tuple[str, ...]):
    def parse(raw: str) -> str:
        value = raw.strip().upper()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


@dataclass(frozen=True)
class KafkaSecurity:
    """How clients authenticate to Kafka and encrypt the connection. Every client FreshRec
    makes — librdkafka, aiokafka, faust — takes them from here.

    >>> KafkaSecurity.from_env({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    ...     "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": "worker",
    ...     "KAFKA_SASL_PASSWORD": "s3cret"}).librdkafka()["sasl.mechanisms"]
    'SCRAM-SHA-512'
    """

    protocol: str = declared(
        "KAFKA_SECURITY_PROTOCOL",
        "PLAINTEXT",
        "`PLAINTEXT`, `SSL`, `SASL_PLAINTEXT` or `SASL_SSL`: every Kafka client FreshRec makes "
        "([security](security.md)).",
        parse=_upper_choice(SECURITY_PROTOCOLS),
    )
    sasl_mechanism: str | None = declared(
        "KAFKA_SASL_MECHANISM",
        None,
        "`PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.",
        parse=_upper_choice(SASL_MECHANISMS),
        shown="`SCRAM-SHA-512` with SASL",
    )
    sasl_username: str | None = declared(
        "KAFKA_SASL_USERNAME", None, "The SASL user; required with `SASL_*`.", kind=str
    )
    sasl_password: str | None = declared(
        "KAFKA_SASL_PASSWORD",
        None,
        "The SASL password; required with `SASL_*`; never logged.",
        repr=False,
    )
    ssl_ca_location: str | None = declared(
        "KAFKA_SSL_CA_LOCATION",
        None,
        "A CA file for `SSL` and `SASL_SSL` (else the system's CAs).",
        kind=str,
        shown="the system's CAs",
    )

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KafkaSecurity:
        security = read_settings(cls, env)
        if security.sasl:
            security = replace(security, sasl_mechanism=security.sasl_mechanism or "SCRAM-SHA-512")
            if not security.sasl_username or not security.sasl_password:
                raise SettingsError(
                    f"KAFKA_SECURITY_PROTOCOL={security.protocol} needs KAFKA_SASL_USERNAME and "
                    "KAFKA_SASL_PASSWORD"
                )
        ca = security.ssl_ca_location
        if ca is not None and not Path(ca).is_file():
            raise SettingsError(f"KAFKA_SSL_CA_LOCATION={ca!r} is not a file")
        return security

    def librdkafka(self) -> dict[str, str]:
        """The settings for a confluent-kafka (librdkafka) client."""
        cfg = {"security.protocol": self.protocol}
        if self.sasl:
            cfg.update(
                {
                    "sasl.mechanisms": self.sasl_mechanism,
                    "sasl.username": self.sasl_username,
                    "sasl.password": self.sasl_password,
                }
            )
        if self.tls and self.ssl_ca_location:
            cfg["ssl.ca.location"] = self.ssl_ca_location
        return cfg

    def aiokafka(self) -> dict:
        """The keyword arguments for an aiokafka client (``RecommendClient``)."""
        kwargs: dict = {"security_protocol": self.protocol}
        if self.sasl:
            kwargs.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        if self.tls:
            kwargs["ssl_context"] = self.ssl_context()
        return kwargs

    def ssl_context(self):
        import ssl

        return ssl.create_default_context(cafile=self.ssl_ca_location)

    def faust_credentials(self):
        """faust's ``broker_credentials`` (None for ``PLAINTEXT``)."""
        import faust

        if self.sasl:
            return faust.SASLCredentials(
                username=self.sasl_username,
                password=self.sasl_password,
                mechanism=self.sasl_mechanism,
                ssl_context=self.ssl_context() if self.tls else None,
            )
        if self.tls:
            return faust.SSLCredentials(self.ssl_context())
        return None


@dataclass(frozen=True)
class ConnectionSettings:
    """Where Kafka and Redis are, and how this deployment names its topics."""

    kafka_bootstrap_servers: str = declared(
        "KAFKA_BOOTSTRAP_SERVERS",
        "127.0.0.1:9092",
        "Comma-separated `host:port` list of the Kafka brokers; with `REDIS_URL`, set to use "
        "existing services (nothing is started).",
        shown="from `stack.env`",
    )
    redis_url: str = declared(
        "REDIS_URL",
        "redis://127.0.0.1:6379/0",
        "`redis://[user:password@]host:port/db`; `rediss://` for TLS "
        "(`?ssl_ca_certs=/path/ca.pem` for a private CA); any node of a Redis Cluster as "
        "`redis+cluster://host:port`.",
        shown="from `stack.env`",
    )
    topic_prefix: str = declared(
        "FRESHREC_TOPIC_PREFIX",
        "",
        "Prepended to every topic name and Redis key, so several deployments or test runs "
        "share one broker and one Redis.",
    )
    kafka_profile: str = declared(
        "FRESHREC_KAFKA_PROFILE",
        "production",
        "Client timings (`freshcore/kafka.py` `PROFILES`, [brokers](brokers.md)): "
        "`production` suits an Apache Kafka cluster, `kafka` Apache Kafka on this machine, "
        "`tansu` the embedded Tansu broker (`local`, its former name, still works).",
        shown="production (`stack.env`: the one that suits the stack's broker)",
    )
    kafka_security: KafkaSecurity = field(default_factory=KafkaSecurity)
    """Authentication and encryption of the Kafka connections. Redis's are in ``redis_url``:
    ``rediss://`` for TLS, the password in it."""
    message_timeout_ms: int | None = declared(
        "FRESHREC_MESSAGE_TIMEOUT_MS",
        None,
        "How long a producer tries to deliver a message before reporting it undelivered "
        "(FreshRec then produces it again: replies, dead letters, gradients).",
        kind=int,
        minimum=1,
        shown="librdkafka's 300,000",
    )
    kafka_session_timeout_ms: int | None = declared(
        "FRESHREC_KAFKA_SESSION_TIMEOUT_MS",
        None,
        "The consumer groups' session timeout, over the profile's: a member silent this long "
        "is dropped from its group.",
        kind=int,
        minimum=1500,
        shown="the profile's (6,000 `kafka` and `tansu`, 45,000 `production`)",
    )
    kafka_group_protocol: str = declared(
        "FRESHREC_KAFKA_GROUP_PROTOCOL",
        "classic",
        "The consumer groups' protocol (librdkafka's `group.protocol`): `classic`, or "
        "`consumer` (KIP-848, Apache Kafka 4 or newer: the broker assigns the partitions, "
        "range-wise, and hands them over incrementally; its `group.consumer.session.timeout.ms` "
        "is the session, and `FRESHREC_KAFKA_SESSION_TIMEOUT_MS` is not used). The streams "
        "app's faust stage stays `classic` "
        "([brokers](brokers.md#the-kip-848-consumer-group-protocol)).",
        choices=GROUP_PROTOCOLS,
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ConnectionSettings:
        return read_settings(cls, env, kafka_security=KafkaSecurity.from_env(env))

    def with_prefix(self, prefix: str) -> ConnectionSettings:
        return replace(self, topic_prefix=prefix)


BOOTSTRAP_SERVERS = declaration(ConnectionSettings, "kafka_bootstrap_servers")
REDIS_URL = declaration(ConnectionSettings, "redis_url")

DLQ_MAX_VALUE_BYTES = Setting(
    "FRESHREC_DLQ_MAX_VALUE_BYTES",
    DeadLetterLimits.max_value_bytes,
    "How much of a rejected value its dead letter keeps (with its length and SHA-256): the "
    "envelope of any record then fits the broker's 1 MB messages.",
    kind=int,
    minimum=0,
)


def dead_letter_limits(env: Mapping[str, str]) -> DeadLetterLimits:
    """How much of a rejected record its dead letter keeps."""
    return DeadLetterLimits(max_value_bytes=DLQ_MAX_VALUE_BYTES.read(env))


ROW_TTL_S = Setting(
    "FRESHREC_ROW_TTL_S",
    30 * 86_400,
    "Rows untouched this long leave memory and Redis, and a user's recent clicks with them "
    "(0: never).",
    kind=int,
    minimum=0,
)
METRICS_PORT = Setting(
    "FRESHREC_METRICS_PORT",
    0,
    "Prometheus `/metrics`, liveness `/healthz` and readiness `/readyz` of a service (0: off).",
    kind=int,
    minimum=0,
)
HOT_K = Setting(
    "FRESHREC_HOT_K",
    500,
    "Length of each published hot list (global and per region), and what a worker keeps.",
    kind=int,
    minimum=1,
)
DEDUPE_WINDOW = Setting(
    "FRESHREC_DEDUPE_WINDOW",
    200_000,
    "Event ids remembered per partition: a duplicate within them is counted and learnt once.",
    kind=int,
    minimum=1,
)


@dataclass(frozen=True)
class RowSettings:
    """What every service that touches embedding rows must agree on, read once here: the
    workers and the parameter servers of one deployment use the same values."""

    dim: int = declared(
        "FRESHREC_EMBEDDING_DIM", 64, "Embedding dimension; a row has `dim + 1` columns.", minimum=1
    )
    max_grad_norm: float = declared(
        "FRESHREC_MAX_GRAD_NORM",
        1.0,
        "A row's aggregated gradient is scaled down to this L2 norm, locally and globally.",
        positive=True,
    )
    row_ttl_s: int = declared_as(ROW_TTL_S)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RowSettings:
        return read_settings(cls, env)


@dataclass(frozen=True)
class HotScoreSettings:
    """The hot score's weights and decay (``freshcore/hotscore.py``): the streams app computes
    it, the worker merges the published lists with it, so both read it here."""

    weights: HotWeights = field(default_factory=HotWeights)
    decay_per_hour: float = declared(
        "FRESHREC_HOT_DECAY_PER_HOUR",
        0.95,
        "What an hour leaves of an item's hot counts (0.95: a 13.5-hour half-life).",
        positive=True,
        maximum=1,
    )
    time_scale: float = declared(
        "FRESHREC_EVENT_TIME_SCALE",
        1.0,
        "How many times faster than the world event times run: a replay at speed sets it, so "
        "decays and windows stay in the world's time (1: live traffic).",
        positive=True,
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HotScoreSettings:
        return read_settings(cls, env)


STOP_GRACE_S = Setting(
    "FRESHREC_STOP_GRACE_S",
    20.0,
    "How long a service asked to stop (SIGTERM, SIGINT) may take before it logs where it was "
    "stuck, dumps every thread's stack and exits with 1 (0: as long as it takes).",
    kind=float,
    minimum=0,
)


def stop_grace_s(env: Mapping[str, str]) -> float:
    """How long a service asked to stop (SIGTERM, SIGINT) may take before it exits anyway
    (0: as long as it takes). Below Kubernetes' default 30 s grace, so the service's own
    account of where it was stuck reaches the log before a SIGKILL."""
    return STOP_GRACE_S.read(env)


METRICS_HOST = Setting(
    "FRESHREC_METRICS_HOST",
    "127.0.0.1",
    "Where a service's metrics and health port listens: loopback unless configured "
    "(`0.0.0.0` in a container that Prometheus or a kubelet reaches).",
)


def metrics_host(env: Mapping[str, str]) -> str:
    """Where a service's ``/metrics``, ``/healthz`` and ``/readyz`` listen: loopback unless
    configured (``0.0.0.0`` in a container that Prometheus or a kubelet reaches from
    outside)."""
    return METRICS_HOST.read(env)
