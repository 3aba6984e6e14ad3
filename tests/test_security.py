"""Closed by default: Kafka security settings and ``rediss://`` URLs reach every client
FreshRec makes (librdkafka, aiokafka, faust, redis-py), bad ones are refused with the
variable's name, and the dashboard escapes what it renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from freshcore.kafka import admin_config, consumer_config, producer_config
from freshcore.settings import ConnectionSettings, KafkaSecurity, SettingsError

SASL = {
    "KAFKA_BOOTSTRAP_SERVERS": "broker:9093",
    "REDIS_URL": "rediss://freshrec-worker:s3cret@redis:6380/0",
    "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "KAFKA_SASL_USERNAME": "worker",
    "KAFKA_SASL_PASSWORD": "kafka-s3cret",
}


@pytest.fixture
def ca_file(tmp_path):
    import ssl

    # any PEM CA the ssl module accepts: the system bundle's first certificate
    bundle = ssl.get_default_verify_paths().cafile
    path = tmp_path / "ca.pem"
    if bundle:
        text = Path(bundle).read_text()
        path.write_text(text[: text.index("-----END CERTIFICATE-----") + 26])
    else:  # pragma: no cover - a system without a CA bundle
        pytest.skip("no system CA bundle to copy a certificate from")
    return str(path)


def test_kafka_security_reaches_every_librdkafka_client(ca_file):
    conn = ConnectionSettings.from_env({**SASL, "KAFKA_SSL_CA_LOCATION": ca_file})
    for cfg in (admin_config(conn), producer_config(conn), consumer_config(conn, "g")):
        assert cfg["security.protocol"] == "SASL_SSL"
        assert cfg["sasl.mechanisms"] == "SCRAM-SHA-512"
        assert (cfg["sasl.username"], cfg["sasl.password"]) == ("worker", "kafka-s3cret")
        assert cfg["ssl.ca.location"] == ca_file
    assert "kafka-s3cret" not in repr(conn)  # never in logs


def test_kafka_security_reaches_the_client_and_faust(ca_file):
    import ssl

    from freshrec.client import RecommendClient

    security = ConnectionSettings.from_env(
        {**SASL, "KAFKA_SSL_CA_LOCATION": ca_file}
    ).kafka_security
    client = RecommendClient("broker:9093", security=security)
    kwargs = client.security.aiokafka()
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == (
        "worker",
        "kafka-s3cret",
    )
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    creds = security.faust_credentials()
    assert (creds.username, creds.password, str(creds.mechanism.value)) == (
        "worker",
        "kafka-s3cret",
        "SCRAM-SHA-512",
    )
    assert isinstance(creds.ssl_context, ssl.SSLContext)


def test_the_streams_app_builds_faust_with_the_credentials(monkeypatch, tmp_path):
    import streams.app as streams_app
    from streams.settings import StreamsSettings

    monkeypatch.setenv("FRESHREC_HOME", str(tmp_path))
    monkeypatch.setattr(streams_app, "_partition_count", lambda settings, topic: 4)  # no broker
    app = streams_app.StreamsApp(StreamsSettings.from_env(SASL)).app
    creds = app.conf.broker_credentials
    assert creds.username == "worker" and str(creds.mechanism.value) == "SCRAM-SHA-512"


def test_a_rediss_url_makes_redis_py_connect_with_tls_and_the_password():
    import redis

    client = redis.Redis.from_url(SASL["REDIS_URL"])
    pool = client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["password"] == "s3cret"
    assert pool.connection_kwargs["username"] == "freshrec-worker"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KAFKA_SECURITY_PROTOCOL": "TLS"}, "KAFKA_SECURITY_PROTOCOL"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "KAFKA_SASL_USERNAME"),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "KERBEROS"},
            "KAFKA_SASL_MECHANISM",
        ),
        ({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CA_LOCATION": "/nope.pem"}, "not a file"),
    ],
)
def test_bad_kafka_security_settings_are_refused_with_the_variables_name(env, message):
    with pytest.raises(SettingsError, match=message):
        KafkaSecurity.from_env(env)


def test_plaintext_is_the_default_and_adds_only_the_protocol():
    assert KafkaSecurity.from_env({}).librdkafka() == {"security.protocol": "PLAINTEXT"}


def test_the_dashboard_escapes_every_value_it_renders_as_markup():
    """Every ``${...}`` in a template that becomes markup goes through ``esc`` (or ``cls``
    for a class name), but for the colours and the computed up/down words."""
    import re
    from importlib import resources

    page = resources.files("freshrec.app").joinpath("web/dashboard.html").read_text()
    assert "function esc(" in page
    allowed = {
        "COLORS[idx % COLORS.length]",
        'ok ? "closed" : "down"',
        'ok ? "up" : "down"',
        'last.cache_hit === null ? "–" : (100 * last.cache_hit).toFixed(1) + "%"',
        'last.cache_host_hit == null ? "–" : (100 * last.cache_host_hit).toFixed(1) + "%"',
    }  # numbers and fixed words
    for template in re.findall(r"`([^`]*<[^`]*)`", page):
        for expr in re.findall(r"\$\{([^}]*)\}", template):
            assert expr.startswith(("esc(", "cls(")) or expr in allowed or "esc(" in expr, expr


def test_a_redis_password_never_reaches_a_log_line_or_an_error(caplog):
    """Redis does not answer at start: the warning and the error name the server, not the
    password in its URL."""
    import logging
    import socket

    import redis

    from freshcore.redisconn import connect

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.INFO)
    secret = "pw-that-must-not-leak"
    client = connect(f"redis://:{secret}@127.0.0.1:{port}/0", socket_connect_timeout=0.2)
    client.close()
    with pytest.raises(redis.exceptions.ConnectionError) as info:
        connect(f"redis+cluster://:{secret}@127.0.0.1:{port}", wait_s=0, socket_connect_timeout=0.2)
    assert f"127.0.0.1:{port}" in caplog.text and f"127.0.0.1:{port}" in str(info.value)
    assert secret not in caplog.text and secret not in str(info.value)
