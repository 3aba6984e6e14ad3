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

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from freshcore.hotscore import HotWeights
from schemas.codec import DeadLetterLimits
from schemas.errors import FreshRecError

STACK_ENV_FILE = "stack.env"


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Every process's log lines (the CLI's and the children services start)."""


class SettingsError(FreshRecError, ValueError):
    """A setting is missing or malformed; the message names the variable."""


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the embedded stack keeps its state (``$FRESHREC_HOME`` or ``./.freshrec``)."""
    env = os.environ if env is None else env
    return Path(env.get("FRESHREC_HOME") or Path.cwd() / ".freshrec")


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
    return Path(env.get("FRESHREC_MODEL_DIR") or state_dir(env) / "models")


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


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name, default) or default


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise SettingsError(f"{name}={value} must be >= {minimum}")
    return value


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """true/false, 1/0, yes/no, on/off (any case); unset or empty: ``default``."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not true or false")


def env_optional_int(
    env: Mapping[str, str], name: str, *, minimum: int | None = None
) -> int | None:
    """``env_int`` for a setting whose absence means "not set" (a default decided
    elsewhere, e.g. by the Kafka profile): None when unset or empty."""
    if not env.get(name):
        return None
    return env_int(env, name, 0, minimum=minimum)


def env_float(
    env: Mapping[str, str],
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
) -> float:
    """A finite number from ``env``, within [minimum, maximum] (and > 0 if ``positive``)."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise SettingsError(f"{name}={raw!r} is not a finite number")
    if positive and value <= 0:
        raise SettingsError(f"{name}={value:g} must be > 0")
    if minimum is not None and value < minimum:
        raise SettingsError(f"{name}={value:g} must be >= {minimum:g}")
    if maximum is not None and value > maximum:
        raise SettingsError(f"{name}={value:g} must be <= {maximum:g}")
    return value


SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True)
class KafkaSecurity:
    """How clients authenticate to Kafka and encrypt the connection: ``KAFKA_SECURITY_PROTOCOL``
    (``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT``, ``SASL_SSL``), ``KAFKA_SASL_MECHANISM``
    (``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512``), ``KAFKA_SASL_USERNAME``,
    ``KAFKA_SASL_PASSWORD``, ``KAFKA_SSL_CA_LOCATION`` (a CA file; else the system's). Every
    client FreshRec makes — librdkafka, aiokafka, faust — takes them from here.

    >>> KafkaSecurity.from_env({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    ...     "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": "worker",
    ...     "KAFKA_SASL_PASSWORD": "s3cret"}).librdkafka()["sasl.mechanisms"]
    'SCRAM-SHA-512'
    """

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_ca_location: str | None = None

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KafkaSecurity:
        protocol = (env.get("KAFKA_SECURITY_PROTOCOL") or "PLAINTEXT").upper()
        if protocol not in SECURITY_PROTOCOLS:
            raise SettingsError(
                f"KAFKA_SECURITY_PROTOCOL={protocol!r}: one of {', '.join(SECURITY_PROTOCOLS)}"
            )
        mechanism = (env.get("KAFKA_SASL_MECHANISM") or "").upper() or None
        user, password = (
            env.get("KAFKA_SASL_USERNAME") or None,
            env.get("KAFKA_SASL_PASSWORD") or None,
        )
        if protocol.startswith("SASL_"):
            mechanism = mechanism or "SCRAM-SHA-512"
            if mechanism not in SASL_MECHANISMS:
                raise SettingsError(
                    f"KAFKA_SASL_MECHANISM={mechanism!r}: one of {', '.join(SASL_MECHANISMS)}"
                )
            if not user or not password:
                raise SettingsError(
                    f"KAFKA_SECURITY_PROTOCOL={protocol} needs KAFKA_SASL_USERNAME and "
                    "KAFKA_SASL_PASSWORD"
                )
        ca = env.get("KAFKA_SSL_CA_LOCATION") or None
        if ca is not None and not Path(ca).is_file():
            raise SettingsError(f"KAFKA_SSL_CA_LOCATION={ca!r} is not a file")
        return cls(protocol, mechanism, user, password, ca)

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

    kafka_bootstrap_servers: str
    """Comma-separated host:port list (``KAFKA_BOOTSTRAP_SERVERS``)."""
    redis_url: str
    """``redis://[:password@]host:port/db`` (``REDIS_URL``)."""
    topic_prefix: str = ""
    """Prepended to every topic name, so several deployments or test runs share one broker."""
    kafka_profile: str = "local"
    """Client tuning: ``local`` suits the embedded broker, ``production`` Apache Kafka."""
    kafka_security: KafkaSecurity = field(default_factory=KafkaSecurity)
    """Authentication and encryption of the Kafka connections (``KAFKA_SECURITY_PROTOCOL``
    and the rest). Redis's are in ``redis_url``: ``rediss://`` for TLS, the password in it."""
    message_timeout_ms: int | None = None
    """How long a producer tries to deliver a message before reporting it undelivered
    (``FRESHREC_MESSAGE_TIMEOUT_MS``; None: librdkafka's 300,000). Replies, dead letters and
    gradients that fail are produced again; drills shorten it to make failures happen."""
    kafka_session_timeout_ms: int | None = None
    """The consumer groups' session timeout, over the profile's
    (``FRESHREC_KAFKA_SESSION_TIMEOUT_MS``; None: 6,000 ``local``, 45,000 ``production``). On
    the embedded broker a group join takes about half of it; a member silent this long is
    dropped from its group."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ConnectionSettings:
        return cls(
            kafka_bootstrap_servers=env_str(env, "KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
            redis_url=env_str(env, "REDIS_URL", "redis://127.0.0.1:6379/0"),
            topic_prefix=env.get("FRESHREC_TOPIC_PREFIX", ""),
            kafka_profile=env_str(env, "FRESHREC_KAFKA_PROFILE", "local"),
            kafka_security=KafkaSecurity.from_env(env),
            message_timeout_ms=env_optional_int(env, "FRESHREC_MESSAGE_TIMEOUT_MS", minimum=1),
            kafka_session_timeout_ms=env_optional_int(
                env, "FRESHREC_KAFKA_SESSION_TIMEOUT_MS", minimum=1500
            ),
        )

    def with_prefix(self, prefix: str) -> ConnectionSettings:
        return replace(self, topic_prefix=prefix)


def dead_letter_limits(env: Mapping[str, str]) -> DeadLetterLimits:
    """How much of a rejected record its dead letter keeps (``FRESHREC_DLQ_MAX_VALUE_BYTES``,
    64 KiB: the envelope of any record then fits the broker's 1 MB messages)."""
    return DeadLetterLimits(
        max_value_bytes=env_int(env, "FRESHREC_DLQ_MAX_VALUE_BYTES", 65_536, minimum=0)
    )


@dataclass(frozen=True)
class RowSettings:
    """What every service that touches embedding rows must agree on, read once here: the
    workers and the parameter servers of one deployment use the same values."""

    dim: int = 64
    """Embedding dimension (``FRESHREC_EMBEDDING_DIM``); a row has ``dim + 1`` columns."""
    max_grad_norm: float = 1.0
    """A row's aggregated gradient is scaled down to this L2 norm, locally and globally
    (``FRESHREC_MAX_GRAD_NORM``)."""
    row_ttl_s: int = 30 * 86_400
    """Rows untouched this long leave memory and Redis (``FRESHREC_ROW_TTL_S``; 0: never)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RowSettings:
        return cls(
            dim=env_int(env, "FRESHREC_EMBEDDING_DIM", 64, minimum=1),
            max_grad_norm=env_float(env, "FRESHREC_MAX_GRAD_NORM", 1.0, positive=True),
            row_ttl_s=env_int(env, "FRESHREC_ROW_TTL_S", 30 * 86_400, minimum=0),
        )


@dataclass(frozen=True)
class HotScoreSettings:
    """The hot score's weights and decay (``freshcore/hotscore.py``): the streams app computes
    it, the worker merges the published lists with it, so both read it here."""

    weights: HotWeights = field(default_factory=HotWeights)
    decay_per_hour: float = 0.95

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HotScoreSettings:
        return cls(
            weights=HotWeights(
                click=env_float(env, "FRESHREC_HOT_WEIGHT_CLICK", 0.6),
                cvr=env_float(env, "FRESHREC_HOT_WEIGHT_CVR", 0.3),
                price=env_float(env, "FRESHREC_HOT_WEIGHT_PRICE", 0.1),
            ),
            decay_per_hour=env_float(
                env, "FRESHREC_HOT_DECAY_PER_HOUR", 0.95, positive=True, maximum=1
            ),
        )


def stop_grace_s(env: Mapping[str, str]) -> float:
    """How long a service asked to stop (SIGTERM, SIGINT) may take before it exits anyway
    (``FRESHREC_STOP_GRACE_S``; 0: as long as it takes). Below Kubernetes' default 30 s grace,
    so the service's own account of where it was stuck reaches the log before a SIGKILL."""
    return env_float(env, "FRESHREC_STOP_GRACE_S", 20.0, minimum=0)


def metrics_host(env: Mapping[str, str]) -> str:
    """Where a service's ``/metrics``, ``/healthz`` and ``/readyz`` listen
    (``FRESHREC_METRICS_HOST``): loopback unless configured (``0.0.0.0`` in a container that
    Prometheus or a kubelet reaches from outside)."""
    return env_str(env, "FRESHREC_METRICS_HOST", "127.0.0.1")
