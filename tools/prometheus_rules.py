"""Generates FreshRec's Prometheus recording and alerting rules
(``deploy/prometheus/rules/freshrec.yml``) from the objectives in ``freshrec/slo.py``, so that
every threshold is a setting with a documented default and a test can hold the shipped file
to it.

    .venv/bin/python -m tools.prometheus_rules                       # rewrites the shipped file
    FRESHREC_SLO_SERVED_S=2 .venv/bin/python -m tools.prometheus_rules --out my-rules.yml
    FRESHREC_COST_CORE_HOUR=0.05 FRESHREC_COST_FIXED_PER_HOUR=0.3 .venv/bin/python -m tools.prometheus_rules

Recording rules (``freshrec:<what>:<window>``) give each SLO figure one name; alerts read
them. Each alert has a ``severity`` (``page``: users are affected now; ``ticket``: look
within the day) and a ``runbook_url`` into ``docs/runbook.md``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from freshrec.cost import CostTerms
from freshrec.slo import SloSettings

OUT = Path(__file__).parents[1] / "deploy" / "prometheus" / "rules" / "freshrec.yml"
RUNBOOK = "docs/runbook.md"  # in the FreshRec repository
LAG = "freshrec_freshness_lag_seconds"
STAGES = ("local", "global_applied", "served", "reply")
SERVICES = ("streams", "worker", "param-server")


def _record(name: str, expr: str) -> dict:
    return {"record": name, "expr": expr}


def _alert(name: str, expr: str, for_: str, severity: str, summary: str) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "runbook_url": f"{RUNBOOK}#{name.lower()}",
        },
    }


def recording_rules(slo: SloSettings, window: str) -> list[dict]:
    """One name per SLO figure, over the rate window ``window``: freshness, serving, and the
    flow of events and feedback."""
    return _freshness_records(slo, window) + _serving_records(window) + _flow_records(window)


def _freshness_records(slo: SloSettings, w: str) -> list[dict]:
    """The freshness lag's p50 and p99 per stage, and the share of events later than each
    objective."""
    rules = []
    for quantile, tag in ((0.5, "p50"), (0.99, "p99")):
        rules.append(
            _record(
                f"freshrec:freshness_lag_seconds:{tag}_{w}",
                f"histogram_quantile({quantile}, sum by (le, stage) (rate({LAG}_bucket[{w}])))",
            )
        )
    for stage, bound in (("served", slo.served_s), ("reply", slo.reply_s)):
        rules.append(
            _record(
                f"freshrec:freshness_late_share:{stage}_{w}",
                f'1 - sum(rate({LAG}_bucket{{stage="{stage}",le="{float(bound)!r}"}}[{w}]))'
                f' / sum(rate({LAG}_count{{stage="{stage}"}}[{w}]))',
            )
        )
    return rules


def _serving_records(w: str) -> list[dict]:
    """Request latency, the replies' tiers, and the shares degraded and expired."""
    return [
        _record(
            f"freshrec:request_seconds:p99_{w}",
            "histogram_quantile(0.99, sum by (le) "
            f'(rate(freshrec_request_seconds_bucket{{stage="total"}}[{w}])))',
        ),
        _record(
            f"freshrec:request_seconds:p99_by_tier_{w}",
            "histogram_quantile(0.99, sum by (le, tier) "
            f'(rate(freshrec_request_seconds_bucket{{stage="total"}}[{w}])))',
        ),
        _record(
            f"freshrec:replies:share_by_tier_{w}",
            f"sum by (tier) (rate(freshrec_replies_total[{w}])) / ignoring (tier) group_left "
            f"sum(rate(freshrec_replies_total[{w}]))",
        ),
        _record(
            f"freshrec:replies_degraded:share_{w}",
            f"sum(rate(freshrec_degraded_replies_total[{w}])) "
            f"/ sum(rate(freshrec_replies_total[{w}]))",
        ),
        _record(
            f"freshrec:requests_expired:share_{w}",
            f'sum(rate(freshrec_requests_total{{outcome="expired"}}[{w}])) '
            f"/ sum(rate(freshrec_requests_total[{w}]))",
        ),
    ]


def _flow_records(w: str) -> list[dict]:
    """Dead letters, consumer lag, how far the global path trails, the event rate, the CTR."""
    return [
        _record(
            f"freshrec:dead_letters:rate_{w}",
            f"sum by (reason) (rate(freshrec_dead_letters_total[{w}]))",
        ),
        _record(
            "freshrec:consumer_lag_messages:sum",
            "sum by (group, topic) (freshrec_consumer_lag_messages)",
        ),
        _record(
            "freshrec:global_applied_behind_seconds",
            'max(freshrec_freshness_event_timestamp_seconds{stage="local"}) - '
            'max(freshrec_freshness_event_timestamp_seconds{stage="global_applied"})',
        ),
        _record(
            f"freshrec:events:rate_{w}",
            # 0, not nothing, when no streams app exports the counter: "no events" must fire
            # when the series is gone, not fall silent with it
            f"sum(rate(freshrec_streams_events_total[{w}])) or vector(0)",
        ),
        _record(
            f"freshrec:ctr:{w}",
            f'sum(rate(freshrec_feedback_events_total{{event_type="click",tier!="unknown"}}[{w}]))'
            " / sum(rate(freshrec_feedback_events_total"
            f'{{event_type="impression",tier!="unknown"}}[{w}]))',
        ),
    ]


def cost_rules(terms: CostTerms, window: str) -> list[dict]:
    """Seed B's cost formula, live (``freshrec.cost.CostTerms``, ``hourly``): USD per hour
    by term and in total, per 1,000 requests (and per mode, from the serving time each
    reply's request took), and per 1,000 events."""
    return _cost_measures(window) + _cost_prices(terms, window)


def _cost_measures(w: str) -> list[dict]:
    """What the formula prices: CPU cores by service and per request or event, the request
    rate and its peak, the serving time per mode, the share of new items shown."""
    cpu = "freshrec_cpu_seconds_total"
    return [
        _record(f"freshrec:cost:cpu_cores_{w}", f"sum by (job) (rate({cpu}[{w}]))"),
        _record(f"freshrec:requests_per_s_{w}", f"sum(rate(freshrec_replies_total[{w}]))"),
        _record(
            f"freshrec:cost:worker_cpu_seconds_per_request_{w}",
            f'sum(rate({cpu}{{job="worker"}}[{w}])) / freshrec:requests_per_s_{w}',
        ),
        _record(
            f"freshrec:cost:cpu_seconds_per_1000_events_{w}",
            f'1000 * sum by (job) (rate({cpu}{{job=~"streams|param-server"}}[{w}])) '
            f"/ on() group_left scalar(sum(rate(freshrec_streams_events_total[{w}])))",
        ),
        _record(
            f"freshrec:cost:serving_seconds_per_1000_requests_{w}",
            f"1000 * sum by (mode) (rate(freshrec_serving_cost_seconds_total[{w}])) "
            f"/ sum by (mode) (rate(freshrec_replies_total[{w}]))",
        ),
        _record(
            "freshrec:cost:peak_requests_per_s_1h",
            f"max_over_time(freshrec:requests_per_s_{w}[1h])",
        ),
        _record(
            f"freshrec:cost:new_item_share_{w}",
            f'sum(rate(freshrec_reply_items_total{{new="true"}}[{w}])) '
            f"/ sum(rate(freshrec_reply_items_total[{w}]))",
        ),
    ]


def _cost_prices(terms: CostTerms, w: str) -> list[dict]:
    """The formula's terms in USD, their total per hour, and the prices per 1,000."""
    price = terms.core_hour
    return [
        _record(
            "freshrec:cost:infrastructure_usd_per_hour",
            f"(sum(freshrec:cost:cpu_cores_{w}) * {price:g} + {terms.fixed_per_hour:g})"
            f" * {terms.overhead:g}",
        ),
        _record(
            "freshrec:cost:peak_usd_per_hour",
            f"freshrec:cost:peak_requests_per_s_1h * freshrec:cost:worker_cpu_seconds_per_request_{w}"
            f" * {price:g} * {terms.safety:g}",
        ),
        _record(
            "freshrec:cost:cold_start_usd_per_hour",
            f"{terms.cold_penalty_per_hour:g} * (freshrec:cost:new_item_share_{w} or vector(0))",
        ),
        _record(
            "freshrec:cost:usd_per_hour",
            "freshrec:cost:infrastructure_usd_per_hour + (freshrec:cost:peak_usd_per_hour or "
            "vector(0)) + freshrec:cost:cold_start_usd_per_hour",
        ),
        _record(
            "freshrec:cost:usd_per_1000_requests",
            f"1000 * freshrec:cost:usd_per_hour / (3600 * freshrec:requests_per_s_{w})",
        ),
        _record(
            "freshrec:cost:usd_per_1000_requests_by_mode",
            f"freshrec:cost:serving_seconds_per_1000_requests_{w} * {price:g} / 3600"
            f" * {terms.overhead:g}",
        ),
        _record(
            "freshrec:cost:usd_per_1000_events",
            f"freshrec:cost:cpu_seconds_per_1000_events_{w} * {price:g} / 3600"
            f" * {terms.overhead:g}",
        ),
    ]


def alerting_rules(slo: SloSettings, window: str, hold: dict[str, str]) -> list[dict]:
    """Every alert, over the rate window ``window``, each held for its kind's ``hold``:
    what users see, the services' health, the global path falling behind, serving tiers
    and the event flow."""
    return (
        _user_facing_alerts(slo, window, hold)
        + _health_alerts(slo, window, hold)
        + _backlog_alerts(slo, window, hold)
        + _traffic_alerts(slo, window, hold)
    )


def _user_facing_alerts(slo: SloSettings, w: str, hold: dict[str, str]) -> list[dict]:
    """Stale rows or replies, requests expiring, replies degraded."""
    p99 = f"freshrec:freshness_lag_seconds:p99_{w}"
    return [
        _alert(
            "FreshrecServedFreshnessSlow",
            f'{p99}{{stage="served"}} > {slo.served_s:g}',
            hold["slo"],
            "page",
            f"p99 of event → served row above {slo.served_s:g} s: users see stale rows",
        ),
        _alert(
            "FreshrecReplyFreshnessSlow",
            f'{p99}{{stage="reply"}} > {slo.reply_s:g}',
            hold["slo"],
            "ticket",
            f"p99 of event → first reply using it above {slo.reply_s:g} s",
        ),
        _alert(
            "FreshrecRequestsTimingOut",
            f"freshrec:requests_expired:share_{w} > {slo.timeout_share:g}",
            hold["slo"],
            "page",
            f"more than {100 * slo.timeout_share:g}% of requests expire unanswered",
        ),
        _alert(
            "FreshrecRepliesDegraded",
            f"freshrec:replies_degraded:share_{w} > {slo.degraded_share:g}",
            hold["slo"],
            "ticket",
            f"more than {100 * slo.degraded_share:g}% of replies degraded or below the full tier",
        ),
    ]


def _health_alerts(slo: SloSettings, w: str, hold: dict[str, str]) -> list[dict]:
    """A breaker left open, dead letters rising, a service down or not scraped at all."""
    return [
        _alert(
            "FreshrecRecallBreakerOpen",
            "max by (channel) (freshrec_breaker_state) == 2",
            hold["breaker"],
            "ticket",
            "a recall channel's breaker has stayed open: its candidates are missing",
        ),
        _alert(
            "FreshrecDeadLettersRising",
            f"sum(freshrec:dead_letters:rate_{w}) > {slo.dead_letters_per_s:g}",
            hold["slo"],
            "ticket",
            f"more than {slo.dead_letters_per_s:g} dead letters a second",
        ),
        _alert(
            "FreshrecServiceDown",
            f'up{{job=~"{"|".join(SERVICES)}"}} == 0',
            hold["down"],
            "page",
            "a FreshRec service does not answer its metrics scrape",
        ),
        _alert(
            "FreshrecServiceAbsent",
            " or ".join(f'absent(up{{job="{job}"}})' for job in SERVICES),
            hold["down"],
            "page",
            "no instance of a FreshRec service is scraped at all (all gone, or none discovered)",
        ),
    ]


def _backlog_alerts(slo: SloSettings, w: str, hold: dict[str, str]) -> list[dict]:
    """A consumer group falling behind, the parameter server trailing the workers."""
    return [
        _alert(
            "FreshrecConsumerLagGrowing",
            f"freshrec:consumer_lag_messages:sum > {slo.consumer_lag_messages:g} and "
            f"deriv(freshrec:consumer_lag_messages:sum[{w}]) > 0",
            hold["slo"],
            "ticket",
            "a consumer group falls further behind its topic",
        ),
        _alert(
            "FreshrecParamServerBehind",
            f"freshrec:global_applied_behind_seconds > {slo.behind_s:g} or "
            # workers learn, and no parameter server has applied anything at all
            '(max(freshrec_freshness_event_timestamp_seconds{stage="local"}) and on() '
            'absent(freshrec_freshness_event_timestamp_seconds{stage="global_applied"}))',
            hold["down"],
            "page",
            f"the parameter server's rows trail the workers' learning by over {slo.behind_s:g} s",
        ),
        _alert(
            "FreshrecParamServerLagging",
            f"freshrec:global_applied_behind_seconds > {slo.behind_warn_s:g}",
            hold["slo"],
            "ticket",
            f"the parameter server's rows trail the workers' learning by over "
            f"{slo.behind_warn_s:g} s (pages at {slo.behind_s:g} s)",
        ),
    ]


def _traffic_alerts(slo: SloSettings, w: str, hold: dict[str, str]) -> list[dict]:
    """A serving tier slower than its objective, no events arriving."""
    return [
        _alert(
            "FreshrecTierLatencySlow",
            " or ".join(
                f'freshrec:request_seconds:p99_by_tier_{w}{{tier="{tier}"}} > {bound:g}'
                for tier, bound in slo.tier_objectives().items()
            ),
            hold["slo"],
            "ticket",
            "a serving tier's p99 is above its objective ("
            + ", ".join(f"{t} {1000 * b:g} ms" for t, b in slo.tier_objectives().items())
            + ")",
        ),
        _alert(
            "FreshrecNoEvents",
            f"freshrec:events:rate_{w} == 0",
            hold["slo"],
            "ticket",
            "no event has arrived on the events topic",
        ),
    ]


def build(
    slo: SloSettings | None = None,
    window: str = "5m",
    hold: dict[str, str] | None = None,
    cost: CostTerms | None = None,
) -> dict:
    """The rule file as a dict; ``window`` is the rate window and ``hold`` each alert kind's
    ``for`` (``slo`` 5m, ``down`` 1m, ``breaker`` from the settings) — shorter only in
    tests."""
    slo = slo or SloSettings()
    hold = {"slo": "5m", "down": "1m", "breaker": f"{slo.breaker_open_s:g}s", **(hold or {})}
    return {
        "groups": [
            {"name": "freshrec-recording", "rules": recording_rules(slo, window)},
            {"name": "freshrec-cost", "rules": cost_rules(cost or CostTerms(), window)},
            {"name": "freshrec-alerts", "rules": alerting_rules(slo, window, hold)},
        ]
    }


def render(slo: SloSettings | None = None, **kwargs) -> str:
    head = "# Generated by `python -m tools.prometheus_rules` from freshrec/slo.py: edit those.\n"
    return head + yaml.safe_dump(build(slo, **kwargs), sort_keys=False, width=1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT})")
    args = ap.parse_args()
    text = render(SloSettings.from_env(os.environ), cost=CostTerms.from_env(os.environ))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
