"""What a recommendation costs: CPU-seconds per 1,000 requests and per 1,000 events from the
services' own resource use, priced per core-hour, and GPU-seconds (the time a service holds a
GPU: billed while held, busy or not) priced per GPU-hour. Pure.

>>> use = {"streams": 12.0, "worker": 30.0, "param-server": 6.0}
>>> c = costs(use, requests=2_000, events=40_000, core_hour=0.04)
>>> c.per_thousand_requests["worker"], c.per_thousand_events["streams"]
(15.0, 0.3)
>>> round(c.price_per_thousand_requests, 6)   # every service's CPU over the requests
0.000267
>>> g = costs(use, 2_000, 40_000, 0.04, gpu_seconds={"worker": 60.0}, gpu_hour=1.2)
>>> g.gpu_per_thousand_requests["worker"], round(g.price_per_thousand_requests, 6)
(30.0, 0.010267)
"""

from __future__ import annotations

from dataclasses import dataclass

from freshcore.declare import declared, read_settings

CORE_HOUR_PRICE = 0.04
"""USD per core-hour by default: a typical on-demand price of one vCPU on a public cloud (an
assumption to replace with your own, ``--core-hour-price``)."""
GPU_HOUR_PRICE = 1.0
"""USD per GPU-hour by default: between an inference GPU's and a training GPU's on-demand
price on a public cloud (an assumption to replace with your own, ``--gpu-hour-price``)."""


@dataclass(frozen=True)
class Costs:
    cpu_seconds: dict[str, float]
    per_thousand_requests: dict[str, float | None]
    per_thousand_events: dict[str, float | None]
    price_per_thousand_requests: float | None
    """Every service's CPU and GPU, priced, over the requests served (USD per 1,000)."""
    gpu_seconds: dict[str, float]
    gpu_per_thousand_requests: dict[str, float | None]


def costs(
    cpu_seconds: dict[str, float],
    requests: float,
    events: float,
    core_hour: float,
    gpu_seconds: dict[str, float] | None = None,
    gpu_hour: float = GPU_HOUR_PRICE,
) -> Costs:
    """Each service's CPU seconds over the requests and over the events of the same span
    (a worker's CPU serves both: each figure is an upper bound for its own side), and the
    GPU-seconds of services that hold a GPU over the requests."""
    gpu = dict(gpu_seconds or {})

    def per(seconds: dict[str, float], count: float) -> dict[str, float | None]:
        return {
            name: round(1000 * s / count, 4) if count > 0 else None for name, s in seconds.items()
        }

    spend = sum(cpu_seconds.values()) / 3600 * core_hour + sum(gpu.values()) / 3600 * gpu_hour
    price = spend * 1000 / requests if requests > 0 else None
    return Costs(
        dict(cpu_seconds),
        per(cpu_seconds, requests),
        per(cpu_seconds, events),
        price,
        gpu,
        per(gpu, requests),
    )


def line(c: Costs, core_hour: float, gpu_hour: float = GPU_HOUR_PRICE) -> str:
    """The run summary's cost line."""

    def f(v: float | None, digits: int) -> str:
        return "–" if v is None else f"{v:.{digits}f}"

    parts = [
        f"{name} {s:.1f} CPU-s ({f(c.per_thousand_requests.get(name), 2)} per 1,000 requests,"
        f" {f(c.per_thousand_events.get(name), 3)} per 1,000 events)"
        for name, s in c.cpu_seconds.items()
    ]
    parts += [
        f"{name} {s:.1f} GPU-s held ({f(c.gpu_per_thousand_requests.get(name), 2)} per 1,000"
        " requests)"
        for name, s in c.gpu_seconds.items()
    ]
    price = c.price_per_thousand_requests
    gpu = f" and ${gpu_hour:g}/GPU-hour" if c.gpu_seconds else ""
    tail = (
        ""
        if price is None
        else f"; all: ${price:.5f} per 1,000 requests at ${core_hour:g}/core-hour{gpu}"
    )
    return "cost: " + "; ".join(parts) + tail


# --------------------------------------------------------------------------- the formula
@dataclass(frozen=True)
class CostTerms:
    """Seed B's cost formula, 总成本 = 基础架构×1.2 + 峰值QPS×每请求成本×安全系数 +
    冷启动惩罚×新商品比例, with each term a setting (``FRESHREC_COST_<FIELD>``):

    - infrastructure: the CPU FreshRec's services use, priced per core-hour, plus what runs
      beside them (brokers, Redis: ``fixed_per_hour``), times ``overhead``;
    - the peak: the highest request rate over the last hour × what one request costs (the
      workers' CPU per request, priced) × ``safety``: capacity held for the spike;
    - cold start: ``cold_penalty_per_hour`` × the share of items in replies that are new
      (created within ``FRESHREC_NEW_ITEM_WINDOW_MS``): what serving unproven items costs.

    The Prometheus rules compute it live (``tools/prometheus_rules.py``,
    ``freshrec:cost:*``); ``hourly`` is the same arithmetic.
    """

    core_hour: float = declared(
        "FRESHREC_COST_CORE_HOUR",
        CORE_HOUR_PRICE,
        "USD per core-hour (an assumption to replace with your own).",
        minimum=0,
    )
    overhead: float = declared(
        "FRESHREC_COST_OVERHEAD",
        1.2,
        "Infrastructure multiplier (seed B's 1.2: what the measured CPU leaves out).",
        minimum=0,
    )
    safety: float = declared(
        "FRESHREC_COST_SAFETY",
        1.5,
        "Peak capacity multiplier (seed B's 安全系数).",
        minimum=0,
    )
    fixed_per_hour: float = declared(
        "FRESHREC_COST_FIXED_PER_HOUR",
        0.0,
        "USD per hour of what runs beside the services (brokers, Redis); 0: not counted.",
        minimum=0,
    )
    cold_penalty_per_hour: float = declared(
        "FRESHREC_COST_COLD_PENALTY_PER_HOUR",
        0.0,
        "USD per hour a catalogue served entirely from new items would cost (exploration, lost conversions); 0: not counted. Seed B gives the term, not its value.",
        minimum=0,
    )

    @classmethod
    def from_env(cls, env) -> CostTerms:
        return read_settings(cls, env)


def hourly(
    terms: CostTerms,
    cpu_cores: float,
    peak_requests_per_s: float,
    worker_cpu_s_per_request: float,
    new_item_share: float,
) -> dict[str, float]:
    """The formula's terms and total, USD per hour.

    >>> t = hourly(CostTerms(core_hour=0.04, fixed_per_hour=0.1, cold_penalty_per_hour=0.5),
    ...            cpu_cores=2.0, peak_requests_per_s=100, worker_cpu_s_per_request=0.002,
    ...            new_item_share=0.1)
    >>> {k: round(v, 6) for k, v in t.items()}
    {'infrastructure': 0.216, 'peak': 0.012, 'cold_start': 0.05, 'total': 0.278}
    """
    infra = (cpu_cores * terms.core_hour + terms.fixed_per_hour) * terms.overhead
    per_request = worker_cpu_s_per_request * terms.core_hour / 3600
    peak = peak_requests_per_s * 3600 * per_request * terms.safety
    cold = terms.cold_penalty_per_hour * new_item_share
    return {"infrastructure": infra, "peak": peak, "cold_start": cold, "total": infra + peak + cold}
