"""docker-compose.yml matches the code: commands parse, env names exist, ports line up.

No Docker engine runs here, so the file is checked statically against the code's settings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from freshrec.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
PROMETHEUS = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
FRESHREC_SERVICES = {n: s for n, s in COMPOSE["services"].items() if s.get("build")}


def env_names_read_by_code() -> set[str]:
    names: set[str] = set()
    for package in (
        "freshcore",
        "freshrec",
        "schemas",
        "streams",
        "inference",
        "param_server",
        "tools",
    ):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"\"((?:FRESHREC|KAFKA|REDIS)_[A-Z0-9_]+)\"", path.read_text()))
    return names


KAFKA_START = (ROOT / "deploy/kafka/start.sh").read_text()


def test_the_stack_has_kafka_kraft_redis_with_aof_and_monitoring():
    services = COMPOSE["services"]
    assert "process.roles=broker,controller" in KAFKA_START
    assert services["kafka"]["entrypoint"][-1] == "/deploy/kafka/start.sh"
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    assert {"prometheus", "grafana", "topic-init"} <= set(services)


def test_kafka_authenticates_every_client_and_enforces_acls():
    listeners = re.search(r"listener.security.protocol.map=(\S+)", KAFKA_START).group(1)
    protocols = dict(pair.split(":") for pair in listeners.split(","))
    assert protocols == {
        "INTERNAL": "SASL_PLAINTEXT",
        "CONTROLLER": "PLAINTEXT",
        "EXTERNAL": "SASL_PLAINTEXT",
    }
    assert "CONTROLLER://localhost:9093" in KAFKA_START  # the plaintext one: loopback only
    assert "allow.everyone.if.no.acl.found=false" in KAFKA_START
    assert "StandardAuthorizer" in KAFKA_START
    for user in ("admin", "streams", "worker", "param-server", "client"):
        assert f"name={user},password=" in KAFKA_START
    for var in re.findall(r"\$\{(KAFKA_[A-Z_]+_PASSWORD)", KAFKA_START):
        assert f"${{{var}:?" in KAFKA_START, f"{var} has a default"
    assert COMPOSE["services"]["topic-init"]["command"] == ["topics", "create", "--acls"]


def test_there_is_no_default_password_anywhere():
    raw = (ROOT / "docker-compose.yml").read_text()
    for var in set(re.findall(r"\$\{([A-Z_]*PASSWORD)", raw)):
        assert f"${{{var}:-" not in raw, f"{var} has a default value"
        assert f"${{{var}:?" in raw
    redis = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "--user default off" in redis and "--user freshrec on" in redis
    grafana = COMPOSE["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_every_published_port_binds_to_loopback_unless_configured():
    for name, svc in COMPOSE["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("${FRESHREC_BIND:-127.0.0.1}:"), f"{name} publishes {port}"


def test_each_service_logs_in_as_its_own_kafka_user_with_the_grants_it_needs():
    from freshrec.acls import service_acls

    acls = service_acls("")
    users = {
        name: svc["environment"]["KAFKA_SASL_USERNAME"] for name, svc in FRESHREC_SERVICES.items()
    }
    assert users == {
        "topic-init": "admin",
        "train": "client",
        "streams": "streams",
        "param-server": "param-server",
        "worker": "worker",
        "worker-gpu": "worker",
    }
    writes = {
        who: {(g.name, g.prefixed) for g in grants if g.operation == "WRITE"}
        for who, grants in acls.items()
    }
    assert ("events", False) not in writes["worker"]  # a worker never writes events
    assert writes["worker"] == {
        ("gradients", False),
        ("recommend.requests.dlq", False),
        ("recommend.replies", True),
    }
    assert writes["client"] == {
        ("recommend.requests", False),
        ("events", False),
        ("items", False),
    }
    assert writes["param-server"] == {("embeddings.updates", False)}
    client_reads = {(g.name, g.prefixed) for g in acls["client"] if g.operation == "READ"}
    assert client_reads == {("recommend.replies", True)}


@pytest.mark.parametrize("name", sorted(FRESHREC_SERVICES))
def test_service_commands_are_real_freshrec_commands(name):
    command = FRESHREC_SERVICES[name]["command"]
    args = build_parser().parse_args(command)
    assert callable(args.func)


@pytest.mark.parametrize("name", sorted(FRESHREC_SERVICES))
def test_service_environment_names_are_read_by_the_code(name):
    env = FRESHREC_SERVICES[name]["environment"]
    unknown = set(env) - env_names_read_by_code()
    assert not unknown, f"{name} sets variables the code never reads: {unknown}"
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert env["REDIS_URL"].startswith("redis://freshrec:${REDIS_PASSWORD:?")  # the ACL user
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"


def test_prometheus_scrapes_each_service_on_its_metrics_port():
    targets = {
        t
        for job in PROMETHEUS["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    targets |= {
        f"{name}:{sd['port']}"
        for job in PROMETHEUS["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name, svc in FRESHREC_SERVICES.items():
        port = svc["environment"].get("FRESHREC_METRICS_PORT")
        if port is not None:
            assert f"{name}:{port}" in targets
    for target in targets:
        host = target.split(":")[0]
        assert host in FRESHREC_SERVICES, f"prometheus scrapes {target}, which compose lacks"


def test_only_user_facing_ports_are_published():
    published = {
        name: svc.get("ports", []) for name, svc in COMPOSE["services"].items() if svc.get("ports")
    }
    assert set(published) <= {"kafka", "grafana", "prometheus"}


# ----------------------------------------------------------------------------- grafana
def _exported_series() -> set[str]:
    """Every series name the code exports (counters with _total, histograms' parts)."""
    from prometheus_client import Counter, Gauge, Histogram

    from freshcore import metrics

    names: set[str] = set()
    for obj in vars(metrics).values():
        if isinstance(obj, Counter):
            names.add(obj._name + "_total")
        elif isinstance(obj, Histogram):
            names |= {obj._name + s for s in ("_bucket", "_sum", "_count")}
        elif isinstance(obj, Gauge):
            names.add(obj._name)
    for collector in metrics.COLLECTORS:  # custom collectors: their families' samples
        for family in collector.collect():
            names |= {sample.name for sample in family.samples}
    return names


def test_every_metric_a_grafana_panel_queries_is_exported():
    import json
    import re

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/freshrec.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"freshrec_[a-z0-9_]+", e)}
    assert queried, "the dashboard queries nothing"
    missing = queried - _exported_series()
    assert not missing, f"panels query series the code does not export: {sorted(missing)}"
    # freshness first, as operators look at it first
    titles = [p["title"] for p in dashboard["panels"]]
    assert titles[0] == "Freshness" and "Freshness lag" in titles[1]


def test_every_grafana_panel_is_a_known_type_with_what_grafana_needs():
    import json

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/freshrec.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dashboard["panels"]:
        assert p["type"] in ("row", "timeseries"), p["type"]  # Grafana's built-in panels
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and 0 < p["gridPos"]["w"] <= 24
        if p["type"] == "timeseries":
            assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
            assert p["fieldConfig"]["defaults"]["unit"]


def test_dashboard_json_is_generated_from_tools_grafana_dashboard():
    from tools.grafana_dashboard import render

    committed = (ROOT / "deploy/grafana/dashboards/freshrec.json").read_text()
    assert committed == render(), "run `python -m tools.grafana_dashboard` and commit the result"


def test_grafana_provisions_the_dashboard_and_its_data_source():
    grafana = COMPOSE["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts["/var/lib/grafana/dashboards"] == "./deploy/grafana/dashboards"
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/freshrec.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert ds["datasources"][0]["uid"] == "prometheus"
