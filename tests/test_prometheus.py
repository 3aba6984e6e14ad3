"""The Prometheus rules: generated from the objectives, valid for ``promtool``, every alert
unit-tested with ``promtool test rules`` and documented in the runbook, and, end to end, a
real Prometheus scraping a running pipeline: the recording rules produce values and stopping
the parameter server fires its alert.

Prometheus and promtool come from Debian's ``prometheus`` package: on PATH, or unpacked into
``.venv/prometheus`` by the Makefile's test target; where they are missing these tests are
skipped with the reason.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from freshcore import clock
from freshrec.slo import SloSettings
from tools.prometheus_rules import build, render

from .test_compose import _exported_series

ROOT = Path(__file__).parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "freshrec.yml"
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
UNPACKED = ROOT / ".venv" / "prometheus" / "usr" / "bin"  # where `make test` unpacks it


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(UNPACKED))


PROMTOOL, PROMETHEUS = _tool("promtool"), _tool("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: `make prometheus` unpacks Debian's package into .venv",
)


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in build()["groups"] for r in g["rules"] if "alert" in r}


# Input series (1-minute samples) and when the alert must be firing, with the labels the
# firing alert carries besides alertname and severity. A healthy system (below) fires none.
CASES: dict[str, tuple[list[tuple[str, str]], str, dict[str, str]]] = {
    "FreshrecServedFreshnessSlow": (
        [
            ('freshrec_freshness_lag_seconds_bucket{stage="served",le="0.5"}', "0+1x30"),
            ('freshrec_freshness_lag_seconds_bucket{stage="served",le="1.0"}', "0+2x30"),
            ('freshrec_freshness_lag_seconds_bucket{stage="served",le="2.0"}', "0+100x30"),
            ('freshrec_freshness_lag_seconds_bucket{stage="served",le="+Inf"}', "0+100x30"),
            ('freshrec_freshness_lag_seconds_count{stage="served"}', "0+100x30"),
        ],
        "10m",
        {"stage": "served"},
    ),
    "FreshrecReplyFreshnessSlow": (
        [
            ('freshrec_freshness_lag_seconds_bucket{stage="reply",le="30.0"}', "0+1x30"),
            ('freshrec_freshness_lag_seconds_bucket{stage="reply",le="60.0"}', "0+100x30"),
            ('freshrec_freshness_lag_seconds_bucket{stage="reply",le="+Inf"}', "0+100x30"),
        ],
        "10m",
        {"stage": "reply"},
    ),
    "FreshrecRequestsTimingOut": (
        [
            ('freshrec_requests_total{outcome="expired"}', "0+10x30"),
            ('freshrec_requests_total{outcome="served"}', "0+90x30"),
        ],
        "10m",
        {},
    ),
    "FreshrecRepliesDegraded": (
        [
            ('freshrec_degraded_replies_total{tier="hot",reason="deadline"}', "0+10x30"),
            ('freshrec_replies_total{tier="full"}', "0+90x30"),
            ('freshrec_replies_total{tier="hot"}', "0+10x30"),
        ],
        "10m",
        {},
    ),
    "FreshrecRecallBreakerOpen": (
        [('freshrec_breaker_state{channel="i2i",job="worker",instance="w1:9101"}', "2x30")],
        "10m",
        {"channel": "i2i"},
    ),
    "FreshrecDeadLettersRising": (
        [('freshrec_dead_letters_total{reason="bad_json",job="streams"}', "0+120x30")],
        "10m",
        {},
    ),
    "FreshrecServiceDown": (
        [('up{job="param-server",instance="ps:9102"}', "1 1 0x30")],
        "10m",
        {"job": "param-server", "instance": "ps:9102"},
    ),
    "FreshrecServiceAbsent": (
        [
            ('up{job="streams",instance="s:9100"}', "1x30"),
            ('up{job="param-server",instance="ps:9102"}', "1x30"),
        ],
        "10m",
        {"job": "worker"},
    ),
    "FreshrecConsumerLagGrowing": (
        [
            (
                'freshrec_consumer_lag_messages{group="freshrec-worker",topic="events",partition="0"}',
                "0+20000x30",
            )
        ],
        "15m",
        {"group": "freshrec-worker", "topic": "events"},
    ),
    "FreshrecParamServerBehind": (
        [
            ('freshrec_freshness_event_timestamp_seconds{stage="local"}', "1000+60x30"),
            ('freshrec_freshness_event_timestamp_seconds{stage="global_applied"}', "1000x30"),
        ],
        "10m",
        {},
    ),
    "FreshrecNoEvents": (
        [('freshrec_streams_events_total{outcome="valid"}', "5x30")],
        "10m",
        {},
    ),
    "FreshrecParamServerLagging": (  # 15 s behind: over the ticket's 10 s, under the page's 30
        [
            ('freshrec_freshness_event_timestamp_seconds{stage="local"}', "1015+60x30"),
            ('freshrec_freshness_event_timestamp_seconds{stage="global_applied"}', "1000+60x30"),
        ],
        "10m",
        {},
    ),
    "FreshrecTierLatencySlow": (  # the cached tier's p99 near 75 ms against its 50 ms
        [
            ('freshrec_request_seconds_bucket{stage="total",tier="cached",le="0.05"}', "0+90x30"),
            ('freshrec_request_seconds_bucket{stage="total",tier="cached",le="0.075"}', "0+97x30"),
            ('freshrec_request_seconds_bucket{stage="total",tier="cached",le="0.1"}', "0+100x30"),
            ('freshrec_request_seconds_bucket{stage="total",tier="cached",le="+Inf"}', "0+100x30"),
            ('freshrec_request_seconds_bucket{stage="total",tier="full",le="0.1"}', "0+100x30"),
            ('freshrec_request_seconds_bucket{stage="total",tier="full",le="+Inf"}', "0+100x30"),
        ],
        "10m",
        {"tier": "cached"},
    ),
}

VANISHED = {
    # the series an alert reads is gone, not at a bad value: the alert still fires
    "FreshrecNoEvents": ([('up{job="streams",instance="s:9100"}', "1x30")], "10m", {}),
    "FreshrecParamServerBehind": (
        [('freshrec_freshness_event_timestamp_seconds{stage="local"}', "1000+60x30")],
        "10m",
        {},
    ),
}

HEALTHY = [
    ('freshrec_freshness_lag_seconds_bucket{stage="served",le="0.5"}', "0+100x30"),
    ('freshrec_freshness_lag_seconds_bucket{stage="served",le="1.0"}', "0+100x30"),
    ('freshrec_freshness_lag_seconds_bucket{stage="served",le="+Inf"}', "0+100x30"),
    ('freshrec_freshness_lag_seconds_count{stage="served"}', "0+100x30"),
    ('freshrec_freshness_lag_seconds_bucket{stage="reply",le="30.0"}', "0+100x30"),
    ('freshrec_freshness_lag_seconds_bucket{stage="reply",le="+Inf"}', "0+100x30"),
    ('freshrec_requests_total{outcome="served"}', "0+100x30"),
    ('freshrec_requests_total{outcome="expired"}', "0x30"),
    ('freshrec_replies_total{tier="full"}', "0+100x30"),
    ('freshrec_degraded_replies_total{tier="hot",reason="deadline"}', "0+1x30"),
    ('freshrec_breaker_state{channel="i2i",job="worker",instance="w1:9101"}', "0x30"),
    ('freshrec_dead_letters_total{reason="bad_json",job="streams"}', "0+1x30"),
    ('up{job="param-server",instance="ps:9102"}', "1x30"),
    ('up{job="streams",instance="s:9100"}', "1x30"),
    ('up{job="worker",instance="w1:9101"}', "1x30"),
    ('freshrec_consumer_lag_messages{group="g",topic="events",partition="0"}', "50x30"),
    ('freshrec_freshness_event_timestamp_seconds{stage="local"}', "1000+60x30"),
    ('freshrec_freshness_event_timestamp_seconds{stage="global_applied"}', "999+60x30"),
    ('freshrec_streams_events_total{outcome="valid"}', "0+600x30"),
    ('freshrec_request_seconds_bucket{stage="total",tier="full",le="0.1"}', "0+99x30"),
    ('freshrec_request_seconds_bucket{stage="total",tier="full",le="0.2"}', "0+100x30"),
    ('freshrec_request_seconds_bucket{stage="total",tier="full",le="+Inf"}', "0+100x30"),
    ('freshrec_request_seconds_bucket{stage="total",tier="hot",le="0.005"}', "0+100x30"),
    ('freshrec_request_seconds_bucket{stage="total",tier="hot",le="+Inf"}', "0+100x30"),
]


def test_the_shipped_rules_are_generated_from_the_objectives():
    assert RULES.read_text() == render(), "run `python -m tools.prometheus_rules` and commit"
    config = yaml.safe_load(CONFIG.read_text())
    assert config["rule_files"] == ["rules/*.yml"]
    assert {j["job_name"] for j in config["scrape_configs"]} == {
        "streams",
        "worker",
        "param-server",
    }


def test_thresholds_are_settings_and_bad_ones_are_refused():
    from freshcore.settings import SettingsError

    slow = SloSettings.from_env({"FRESHREC_SLO_SERVED_S": "2", "FRESHREC_SLO_BEHIND_S": "60"})
    exprs = {
        r["alert"]: r["expr"] for g in build(slow)["groups"] for r in g["rules"] if "alert" in r
    }
    assert exprs["FreshrecServedFreshnessSlow"].endswith("> 2")
    assert exprs["FreshrecParamServerBehind"].startswith(
        "freshrec:global_applied_behind_seconds > 60 or "
    )
    for bad in ({"FRESHREC_SLO_SERVED_S": "0.9"}, {"FRESHREC_SLO_TARGET": "1"}):
        with pytest.raises(SettingsError):
            SloSettings.from_env(bad)


def test_every_alert_has_a_unit_test_a_severity_and_a_runbook_entry():
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    sections = set(re.findall(r"^## (Freshrec\w+)$", runbook, re.M))
    assert set(alerts()) == set(CASES) == sections
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in ("page", "ticket"), name
        assert rule["annotations"]["runbook_url"] == f"docs/runbook.md#{name.lower()}"


def test_every_series_the_rules_read_is_exported_by_the_code():
    exprs = [r["expr"] for g in build()["groups"] for r in g["rules"]]
    read = {m for e in exprs for m in re.findall(r"\bfreshrec_[a-z0-9_]+", e)}
    assert read and not read - _exported_series(), sorted(read - _exported_series())


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules():
    for args in (["check", "rules", str(RULES)], ["check", "config", str(CONFIG)]):
        proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_unit_tests_fire_each_alert_on_its_input_and_none_when_healthy(tmp_path):
    rules = alerts()

    def expected(name: str, labels: dict[str, str]) -> dict:
        rule = rules[name]
        return {
            "exp_labels": {"severity": rule["labels"]["severity"], **labels},
            "exp_annotations": rule["annotations"],
        }

    cases = [(name, name, case) for name, case in CASES.items()]
    cases += [(f"{name}, its series vanished", name, case) for name, case in VANISHED.items()]
    tests = [
        {
            "name": title,
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "alert_rule_test": [
                {"eval_time": at, "alertname": name, "exp_alerts": [expected(name, labels)]}
            ],
        }
        for title, name, (series, at, labels) in cases
    ]
    tests.append(
        {
            "name": "healthy",
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in HEALTHY],
            "alert_rule_test": [
                {"eval_time": "15m", "alertname": name, "exp_alerts": []} for name in rules
            ],
        }
    )
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    spec = tmp_path / "freshrec_test.yml"
    spec.write_text(
        yaml.safe_dump(
            {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests},
            sort_keys=False,
        )
    )
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_computes_the_cost_formula_as_freshrec_cost_does(tmp_path):
    """Seed B's formula, live: 2 cores in all (the worker 1), 100 requests/s, a tenth of the
    listed items new, 1,000 events/s; the rules give what ``freshrec.cost.hourly`` gives."""
    from freshrec.cost import CostTerms, hourly

    terms = CostTerms(fixed_per_hour=0.1, cold_penalty_per_hour=0.5)
    want = hourly(terms, 2.0, 100.0, 0.01, 0.1)
    series = [
        ('freshrec_cpu_seconds_total{job="worker"}', "0+60x40"),
        ('freshrec_cpu_seconds_total{job="streams"}', "0+30x40"),
        ('freshrec_cpu_seconds_total{job="param-server"}', "0+30x40"),
        ('freshrec_replies_total{tier="full",mode="daily"}', "0+6000x40"),
        ('freshrec_serving_cost_seconds_total{mode="daily"}', "0+30x40"),
        ('freshrec_reply_items_total{new="true"}', "0+6000x40"),
        ('freshrec_reply_items_total{new="false"}', "0+54000x40"),
        ('freshrec_streams_events_total{outcome="valid"}', "0+60000x40"),
    ]

    def sample(expr: str, value: float, *labels: str) -> dict:
        """The rule's value in nano-dollars, rounded: promtool compares floats exactly."""
        return {
            "expr": f"round(1e9 * {expr})",
            "eval_time": "30m",
            "exp_samples": [
                {"labels": label, "value": float(math.floor(1e9 * value + 0.5))}
                for label in labels or ("{}",)
            ],
        }

    per_1000_events = 0.5 * 0.04 / 3600 * 1.2  # half a core each over 1,000 events/s
    exprs = [
        sample("freshrec:cost:infrastructure_usd_per_hour", want["infrastructure"]),
        sample("freshrec:cost:peak_usd_per_hour", want["peak"]),
        sample("freshrec:cost:cold_start_usd_per_hour", want["cold_start"]),
        sample("freshrec:cost:usd_per_hour", want["total"]),
        sample("freshrec:cost:usd_per_1000_requests", 1000 * want["total"] / (3600 * 100)),
        sample(
            "freshrec:cost:usd_per_1000_requests_by_mode",
            5.0 * 0.04 / 3600 * 1.2,  # 5 ms of serving a request
            '{mode="daily"}',
        ),
        sample(
            "freshrec:cost:usd_per_1000_events",
            per_1000_events,
            '{job="param-server"}',
            '{job="streams"}',
        ),
    ]
    (tmp_path / "rules.yml").write_text(render(cost=terms))
    spec = tmp_path / "cost_test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": ["rules.yml"],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [{"series": s, "values": v} for s, v in series],
                        "promql_expr_test": exprs,
                    }
                ],
            },
            sort_keys=False,
        )
    )
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- end to end
def _api(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=5) as resp:
        return json.loads(resp.read())["data"]


def _probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_readiness_needs_partitions_and_redis_and_liveness_a_loop_that_goes_round(services):
    from freshcore import metrics as m
    from freshcore.endpoints import start_endpoints
    from freshcore.health import HEALTH
    from freshrec.app.stack import free_port

    port = free_port()
    server = start_endpoints("127.0.0.1", port, redis_url=services.redis_url)
    try:
        m.ASSIGNED_PARTITIONS.labels("test").set(0)
        gauge = m.ASSIGNED_PARTITIONS.collect()[0]
        owned = sum(s.value for s in gauge.samples)
        if owned == 0:  # nothing else in this process owns partitions
            code, why = _probe(port, "/readyz")
            assert (code, why.strip()) == (503, "no partitions assigned")
        m.ASSIGNED_PARTITIONS.labels("test").set(3)
        code, why = _probe(port, "/readyz")
        assert code == 200 and "Redis reachable" in why, why
        HEALTH.beat()
        assert _probe(port, "/healthz")[0] == 200
        assert _probe(port, "/metrics")[0] == 200 and _probe(port, "/nope")[0] == 404
        HEALTH.beat(now=time.monotonic() - HEALTH.stall_s - 1)  # a loop stuck that long
        assert _probe(port, "/healthz")[0] == 503
    finally:
        HEALTH.beat()
        m.ASSIGNED_PARTITIONS.labels("test").set(0)
        server.shutdown()
    dead = start_endpoints("127.0.0.1", free_port(), redis_url="redis://127.0.0.1:1/0")
    try:
        m.ASSIGNED_PARTITIONS.labels("test").set(3)
        code, why = _probe(dead.server_address[1], "/readyz")
        assert (code, why.strip()) == (503, "Redis unreachable")
    finally:
        m.ASSIGNED_PARTITIONS.labels("test").set(0)
        HEALTH.redis(True)
        dead.shutdown()


def _query(port: int, expr: str) -> list[dict]:
    from urllib.parse import quote

    return _api(port, f"query?query={quote(expr)}")["result"]


@pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)"
)
def test_a_real_prometheus_records_the_pipeline_and_alerts_when_the_parameter_server_stops(
    seeded, model_dir, tmp_path
):
    from freshrec.app.stack import free_port
    from schemas.records import Event

    from .conftest import wait_for
    from .serving_harness import DIM
    from .streams_harness import produce, service, stop

    ports = {job: free_port() for job in ("streams", "worker", "param-server")}
    # the shipped configuration, pointed at these processes, scraping and evaluating each
    # second; the shipped rules with 30 s windows and short holds
    config = yaml.safe_load(CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = ["rules.yml"]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "rules.yml").write_text(
        render(window="30s", hold={"slo": "10s", "down": "3s", "breaker": "10s"})
    )
    web = free_port()
    env = {
        "FRESHREC_MODEL_DIR": str(model_dir),
        "FRESHREC_EMBEDDING_DIM": str(DIM),
        "FRESHREC_FLUSH_INTERVAL_MS": "100",
    }
    with ExitStack() as stack:
        procs = {
            job: stack.enter_context(
                service(
                    seeded, job, tmp_path / f"{job}.log", FRESHREC_METRICS_PORT=str(port), **env
                )
            )
            for job, port in ports.items()
        }
        prom = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web}",
            ],
            stdout=open(tmp_path / "prometheus.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        stack.callback(lambda: (prom.terminate(), prom.wait(15)))

        def targets_up() -> bool:
            try:
                active = _api(web, "targets")["activeTargets"]
            except OSError:
                return False
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        wait_for(targets_up, 90, 0.5, what="Prometheus scraping the three services")
        # the probes an orchestrator uses, on the same port (loopback: the default host)
        for job, port in ports.items():
            wait_for(lambda p=port: _probe(p, "/readyz")[0] == 200, 60, 0.5, what=f"{job} ready")
            assert _probe(port, "/healthz")[0] == 200, job
        users = [f"u{n}" for n in range(30)]

        stages = ("local", "global_applied", "served")

        def recorded() -> dict[str, float] | None:
            """The p99 per stage once every stage has one (a stage with no observation in
            the rule's 30 s window records NaN): steady clicks meanwhile."""
            now = clock.now_ms()
            clicks = [Event(f"p{now}-{u}", "click", u, f"i{n}", now) for n, u in enumerate(users)]
            produce(seeded, clicks)
            p99 = {
                r["metric"].get("stage"): float(r["value"][1])
                for r in _query(web, "freshrec:freshness_lag_seconds:p99_30s")
            }
            return p99 if all(s in p99 and not math.isnan(p99[s]) for s in stages) else None

        p99 = wait_for(recorded, 120, 1.0, what="the freshness recording rules to have values")
        assert all(0 < p99[s] < 60 for s in stages), p99
        assert _query(web, "freshrec:global_applied_behind_seconds"), "behind not recorded"
        firing = lambda: [  # noqa: E731
            a
            for a in _api(web, "alerts")["alerts"]
            if a["labels"]["alertname"] == "FreshrecServiceDown" and a["state"] == "firing"
        ]
        assert not firing()
        stop(procs["param-server"])
        wait_for(firing, 60, 0.5, what="FreshrecServiceDown to fire")
        assert {a["labels"]["job"] for a in firing()} == {"param-server"}
