"""The panels of the Grafana dashboard, row by row: every query in one reviewable place, so
a test can check each metric it names against what the code exports
(``tools/grafana_dashboard.py`` lays them out and writes the JSON)."""

from __future__ import annotations

from freshrec.slo import SloSettings

SLO = SloSettings()


def _fb(event_type: str, by: str = "") -> str:
    """Rate of feedback events of one type: summed over the replies a worker knows it
    served, or by a label."""
    group = f" by ({by})" if by else ""
    known = "" if by else ',tier!="unknown"'
    sel = f'{{event_type="{event_type}"{known}}}'
    return f"sum{group} (rate(freshrec_feedback_events_total{sel}[5m]))"


def _burn(stage: str, bound_s: float) -> str:
    """The error budget's burn rate: the share of a stage's events later than its objective
    over the share the SLO allows (``freshrec.slo``)."""
    le = f"{float(bound_s)!r}"
    within = f'sum(rate(freshrec_freshness_lag_seconds_bucket{{stage="{stage}",le="{le}"}}[5m]))'
    every = f'sum(rate(freshrec_freshness_lag_seconds_count{{stage="{stage}"}}[5m]))'
    return f"(1 - {within} / {every}) / {1 - SLO.target:g}"


def q(quantile: float, metric: str, by: str, where: str = "") -> str:
    sel = f"{{{where}}}" if where else ""
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({metric}_bucket{sel}[1m])))"


def lag_panel(quantile: float, tag: str) -> tuple[str, str, list[tuple[str, str]], int]:
    """The freshness lag's ``quantile`` per stage, the hot lists' and the co-visitation
    lists' beside it."""
    return (
        f"Freshness lag {tag} per stage",
        "s",
        [
            (q(quantile, "freshrec_freshness_lag_seconds", "stage"), f"{tag} {{{{stage}}}}"),
            (q(quantile, "freshrec_hot_list_lag_seconds", "job"), f"{tag} hot list"),
            (
                q(quantile, "freshrec_streams_stage_lag_seconds", "stage", 'stage="covisit"'),
                f"{tag} co-visitation lists",
            ),
        ],
        12,
    )


# (title, unit, [(expr, legend)], width)
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], int]]]] = [
    (
        "Freshness",
        [
            lag_panel(0.99, "p99"),
            lag_panel(0.5, "p50"),
            (
                "Global path behind local (event time; grows while it is down)",
                "s",
                [
                    (
                        'max(freshrec_freshness_event_timestamp_seconds{stage="local"}) - '
                        'max(freshrec_freshness_event_timestamp_seconds{stage="served"})',
                        "served behind local",
                    ),
                    (
                        'max(freshrec_freshness_event_timestamp_seconds{stage="local"}) - '
                        'max(freshrec_freshness_event_timestamp_seconds{stage="global_applied"})',
                        "applied behind local",
                    ),
                ],
                12,
            ),
            (
                "Consumer lag (from the consumers' fetch responses)",
                "short",
                [
                    (
                        "sum by (group, topic) (freshrec_consumer_lag_messages)",
                        "{{group}} {{topic}}",
                    ),
                ],
                12,
            ),
            (
                "Worker: where the local lag goes (p99)",
                "s",
                [
                    (
                        q(0.99, "freshrec_worker_fetch_lag_seconds", "job"),
                        "fetch (producer → consume)",
                    ),
                    (q(0.99, "freshrec_worker_loop_seconds", "phase"), "loop {{phase}}"),
                ],
                12,
            ),
            (
                "Pending local steps / event backlog",
                "short",
                [
                    ("sum(freshrec_pending_local_steps)", "pending local steps"),
                    (
                        "sum(rate(freshrec_pending_local_steps_let_go_total[1m]))",
                        "steps let go /s (pool at its bound)",
                    ),
                    ("sum(freshrec_worker_event_backlog)", "worker event backlog"),
                    (
                        "sum by (reason) (rate(freshrec_worker_event_pauses_total[1m]))",
                        "event partitions paused /s ({{reason}})",
                    ),
                ],
                12,
            ),
        ],
    ),
    (
        "Quality of served recommendations",
        [
            (
                "CTR per tier (clicks / impressions of events naming a reply)",
                "percentunit",
                [
                    (f"{_fb('click')} / {_fb('impression')}", "CTR"),
                    (f"{_fb('click', 'tier')} / {_fb('impression', 'tier')}", "CTR {{tier}}"),
                ],
                12,
            ),
            (
                "CVR (conversions / clicks) and the freshness SLO's burn rate",
                "short",
                [
                    (f"{_fb('conversion')} / {_fb('click')}", "CVR"),
                    (_burn("served", SLO.served_s), f"burn: served within {SLO.served_s:g} s"),
                    (_burn("reply", SLO.reply_s), f"burn: reply within {SLO.reply_s:g} s"),
                ],
                12,
            ),
        ],
    ),
    (
        "Throughput",
        [
            (
                "Events",
                "ops",
                [
                    (
                        "sum by (outcome) (rate(freshrec_streams_events_total[1m]))",
                        "streams {{outcome}}",
                    ),
                    ("sum(rate(freshrec_streams_counted_events_total[1m]))", "streams counted"),
                    (
                        "sum by (outcome) (rate(freshrec_worker_events_total[1m]))",
                        "worker {{outcome}}",
                    ),
                ],
                8,
            ),
            (
                "Dead letters by reason",
                "ops",
                [
                    ("sum by (reason) (rate(freshrec_dead_letters_total[1m]))", "{{reason}}"),
                    ("sum(rate(freshrec_streams_late_events_total[1m]))", "late events"),
                    ("sum(rate(freshrec_streams_replayed_events_total[1m]))", "replayed (skipped)"),
                ],
                8,
            ),
            (
                "Gradients, rows applied, updates installed",
                "ops",
                [
                    (
                        "sum by (outcome) (rate(freshrec_gradient_rows_total[1m]))",
                        "gradient rows {{outcome}}",
                    ),
                    (
                        "sum by (table) (rate(freshrec_ps_rows_applied_total[1m]))",
                        "applied {{table}}",
                    ),
                    (
                        "sum by (outcome) (rate(freshrec_updates_installed_total[1m]))",
                        "updates {{outcome}}",
                    ),
                    (
                        'sum(rate(freshrec_ps_broadcast_messages_total{outcome="failed"}[1m]))',
                        "broadcasts failed",
                    ),
                ],
                8,
            ),
        ],
    ),
    (
        "Serving",
        [
            (
                "Request latency p99 per stage",
                "s",
                [
                    (q(0.99, "freshrec_request_seconds", "stage"), "p99 {{stage}}"),
                ],
                8,
            ),
            (
                "Request latency p99 per tier",
                "s",
                [
                    (q(0.99, "freshrec_request_seconds", "tier", 'stage="total"'), "p99 {{tier}}"),
                ],
                8,
            ),
            (
                "Requests",
                "ops",
                [
                    ("sum by (outcome) (rate(freshrec_requests_total[1m]))", "{{outcome}}"),
                    ("sum by (tier) (rate(freshrec_replies_total[1m]))", "reply tier {{tier}}"),
                ],
                8,
            ),
            (
                "Serving mode: workers per mode, replies per mode, latency p99 per mode",
                "short",
                [
                    ("sum by (mode) (freshrec_mode_info)", "workers in {{mode}}"),
                    ("sum by (mode) (rate(freshrec_replies_total[1m]))", "replies/s {{mode}}"),
                    (
                        q(0.99, "freshrec_request_seconds", "mode", 'stage="total"'),
                        "p99 s {{mode}}",
                    ),
                ],
                8,
            ),
            (
                "Degraded replies by reason",
                "ops",
                [
                    (
                        "sum by (tier, reason) (rate(freshrec_degraded_replies_total[1m]))",
                        "{{tier}} {{reason}}",
                    ),
                ],
                8,
            ),
            (
                "Recall channel calls (timeouts, breaker skips)",
                "ops",
                [
                    (
                        "sum by (channel, outcome) (rate(freshrec_recall_calls_total[1m]))",
                        "{{channel}} {{outcome}}",
                    ),
                ],
                8,
            ),
            (
                "Breaker state (0 closed, 1 half-open, 2 open)",
                "short",
                [
                    ("max by (channel) (freshrec_breaker_state)", "{{channel}}"),
                ],
                8,
            ),
            (
                "Batch size",
                "short",
                [
                    (
                        "sum(rate(freshrec_request_batch_size_sum[1m])) / sum(rate(freshrec_request_batch_size_count[1m]))",
                        "mean requests per batch",
                    ),
                ],
                8,
            ),
            (
                "Cache lookups by tier",
                "ops",
                [
                    (
                        "sum by (table, tier) (rate(freshrec_cache_lookups_total[1m]))",
                        "{{table}} {{tier}}",
                    ),
                ],
                8,
            ),
            (
                "Ranking time per model (one forward pass over a batch), p99",
                "s",
                [
                    (q(0.99, "freshrec_ranking_batch_seconds", "ranker"), "p99 {{ranker}}"),
                    (q(0.5, "freshrec_ranking_batch_seconds", "ranker"), "p50 {{ranker}}"),
                ],
                8,
            ),
            (
                "CTR per experiment variant (5 min)",
                "percentunit",
                [
                    (
                        'sum by (experiment, variant) (rate(freshrec_experiment_events_total{event_type="click"}[5m]))'
                        " / sum by (experiment, variant) "
                        '(rate(freshrec_experiment_events_total{event_type="impression"}[5m]))',
                        "{{experiment}} {{variant}}",
                    ),
                ],
                8,
            ),
            (
                "Model in use",
                "short",
                [
                    ("max by (version) (freshrec_model_info)", "{{version}}"),
                    (
                        "sum by (outcome) (increase(freshrec_model_reloads_total[5m]))",
                        "reloads {{outcome}}",
                    ),
                ],
                8,
            ),
        ],
    ),
    (
        "Cost (seed B's formula: freshrec/cost.py, the freshrec:cost:* rules)",
        [
            (
                "Cost per 1,000 requests (USD), in all and by mode",
                "currencyUSD",
                [
                    ("freshrec:cost:usd_per_1000_requests", "all services, the formula"),
                    ("freshrec:cost:usd_per_1000_requests_by_mode", "serving, {{mode}}"),
                ],
                8,
            ),
            (
                "Cost per 1,000 events (USD) by service",
                "currencyUSD",
                [("freshrec:cost:usd_per_1000_events", "{{job}}")],
                8,
            ),
            (
                "Cost per hour (USD) by term of the formula",
                "currencyUSD",
                [
                    ("freshrec:cost:infrastructure_usd_per_hour", "infrastructure × overhead"),
                    ("freshrec:cost:peak_usd_per_hour", "peak QPS × per request × safety"),
                    ("freshrec:cost:cold_start_usd_per_hour", "cold-start penalty × new share"),
                    ("freshrec:cost:usd_per_hour", "total"),
                ],
                8,
            ),
        ],
    ),
    (
        "Internals",
        [
            (
                "GPU memory of workers on a GPU (allocated, reserved, fragmented, total)",
                "bytes",
                [
                    (
                        "max by (instance, kind) (freshrec_device_memory_bytes)",
                        "{{instance}} {{kind}}",
                    )
                ],
                8,
            ),
            (
                "Parameter server flush time",
                "s",
                [
                    (q(0.99, "freshrec_ps_flush_seconds", "job"), "p99 flush"),
                    (
                        "sum by (outcome) (rate(freshrec_ps_flushes_total[1m]))",
                        "flushes {{outcome}}",
                    ),
                ],
                8,
            ),
            (
                "Streams batches",
                "s",
                [
                    (q(0.99, "freshrec_streams_batch_seconds", "stage"), "p99 {{stage}}"),
                ],
                8,
            ),
            (
                "Resident rows, catalogue, partitions",
                "short",
                [
                    ("sum by (table) (freshrec_cache_rows)", "rows {{table}}"),
                    ("sum by (table) (freshrec_cache_host_rows)", "host RAM rows {{table}}"),
                    ("max(freshrec_catalogue_items)", "catalogue items"),
                    ("sum by (service) (freshrec_assigned_partitions)", "partitions {{service}}"),
                    ("sum(freshrec_streams_item_partitions)", "streams item partitions"),
                ],
                8,
            ),
            (
                "Rows let go, ranking out of memory (/s)",
                "short",
                [
                    (
                        "sum by (table) (rate(freshrec_cache_rows_evicted_total[5m]))",
                        "evicted at the bound {{table}}",
                    ),
                    (
                        "sum by (table) (rate(freshrec_cache_rows_expired_total[5m]))",
                        "expired {{table}}",
                    ),
                    ("sum by (model) (rate(freshrec_ranking_oom_total[5m]))", "OOM {{model}}"),
                ],
                8,
            ),
        ],
    ),
]
