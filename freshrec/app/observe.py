"""Headline figures of a running FreshRec, from its services' own /metrics endpoints — what
``freshrec dashboard`` charts and ``freshrec top`` prints, computed one way for both.

``Observer.sample()`` scrapes every target and keeps a short history of scrapes; figures over
a window (quantiles, rates) are differences between the newest scrape and one ``window_s``
older, as Prometheus' ``rate``/``histogram_quantile`` would compute them.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from freshrec.promtext import Samples, histogram_quantile, merge, scrape, subtract, total
from freshrec.slo import SloSettings, burn_rate

STAGES = ("local", "global_applied", "served", "reply")
LAG = "freshrec_freshness_lag_seconds"
NEWEST = "freshrec_freshness_event_timestamp_seconds"
REQUEST_STAGES = ("topic", "queue", "recall", "rank", "rerank", "total")
"""The ``stage`` label values of ``freshrec_request_seconds``."""


def targets_file(state: Path) -> Path:
    return state / "run" / "services.json"


def write_targets(state: Path, targets: Mapping[str, str]) -> None:
    path = targets_file(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(targets), indent=2))


def read_targets(state: Path) -> dict[str, str]:
    try:
        return json.loads(targets_file(state).read_text())
    except FileNotFoundError:
        return {}


def parse_targets(spec: str) -> dict[str, str]:
    """``"worker=localhost:9101,streams=localhost:9100"`` → {name: metrics URL}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, where = part.partition("=")
        if not sep:
            raise ValueError(f"expected name=host:port, got {part!r}")
        out[name] = where if where.startswith("http") else f"http://{where}/metrics"
    return out


def _ms(v: float) -> float | None:
    return None if math.isnan(v) else round(v * 1000, 1)


@dataclass
class Headline:
    t: float
    freshness_p50_ms: dict[str, float | None] = field(default_factory=dict)
    freshness_p99_ms: dict[str, float | None] = field(default_factory=dict)
    behind_s: dict[str, float | None] = field(default_factory=dict)
    """How far the global path is behind the worker's learning, in seconds of event time:
    ``served`` (rows installed from the broadcast) and ``global_applied`` (rows persisted by
    the parameter server), each the newest event time learnt minus the newest it reached.
    Unlike the lag histograms it keeps growing while that path is down."""
    consumer_lag: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float | None] = field(default_factory=dict)
    tiers: dict[str, float] = field(default_factory=dict)
    breakers: dict[str, str] = field(default_factory=dict)
    cache_hit: float | None = None
    """Share of embedding rows looked up that the device held."""
    cache_host_hit: float | None = None
    """Share that host RAM, the cache's second level, held."""
    up: dict[str, bool] = field(default_factory=dict)
    model: str | None = None
    quality: dict[str, float | None] = field(default_factory=dict)
    """CTR and CVR of served recommendations over the window: ``ctr``, ``cvr`` and
    ``ctr_<tier>`` (from the events naming a reply, ``freshrec_feedback_events_total``)."""
    variants: dict[str, float | None] = field(default_factory=dict)
    """CTR over the window per A/B experiment variant, ``experiment/variant`` (from the
    streams app's attribution, ``freshrec_experiment_events_total``)."""
    slo: dict[str, float | None] = field(default_factory=dict)
    """Per freshness objective (``served``, ``reply``): the share of the window's events
    later than it, and the burn rate of its error budget (``served_burn``)."""


class Observer:
    def __init__(self, targets: Mapping[str, str], window_s: float = 10.0, keep: int = 600):
        self.targets = dict(targets)
        self.window_s = window_s
        self.slo = SloSettings.from_env(os.environ)  # read once, not every sample
        self._scrapes: deque[tuple[float, Samples, dict[str, bool]]] = deque()
        self.history: deque[Headline] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def sample(self) -> Headline:
        up, parts = {}, []
        for name, url in self.targets.items():
            try:
                parts.append(scrape(url, timeout_s=1.0))
                up[name] = True
            except OSError:
                up[name] = False
        now = time.time()
        samples = merge(*parts)
        self._scrapes.append((now, samples, up))
        while len(self._scrapes) > 2 and now - self._scrapes[1][0] >= self.window_s:
            self._scrapes.popleft()
        h = headline(self._scrapes[0], (now, samples, up), self.slo)
        with self._lock:
            self.history.append(h)
        return h

    def series(self) -> dict:
        with self._lock:
            hist = list(self.history)
        return {"targets": self.targets, "points": [h.__dict__ for h in hist]}


def behind(samples: Samples) -> dict[str, float | None]:
    """``Headline.behind_s`` of one scrape (any number of services merged): per stage of the
    global path, the newest event time learnt minus the newest it reached, in seconds (None
    until both are known)."""
    newest = {
        stage: max(
            (v for labels, v in samples.get(NEWEST, []) if labels.get("stage") == stage and v > 0),
            default=None,
        )
        for stage in STAGES
    }
    learnt = newest["local"]
    return {
        stage: None
        if newest[stage] is None or learnt is None
        else round(max(learnt - newest[stage], 0.0), 2)
        for stage in ("global_applied", "served")
    }


def headline(
    before: tuple[float, Samples, dict],
    after: tuple[float, Samples, dict],
    slo: SloSettings | None = None,
) -> Headline:
    t0, s0, _ = before
    t1, s1, up = after
    dt = max(t1 - t0, 1e-9)
    h = Headline(t=round(t1, 3), up=up)
    window = _window(s0, s1, t0, t1, LAG + "_bucket")
    hot = _window(s0, s1, t0, t1, "freshrec_hot_list_lag_seconds_bucket")
    h.freshness_p50_ms, h.freshness_p99_ms = _freshness(window, hot)
    h.behind_s = behind(s1)
    h.consumer_lag = _consumer_lag(s1)
    h.rates = _rates(s0, s1, dt)
    h.latency_ms = _latency(_window(s0, s1, t0, t1, "freshrec_request_seconds_bucket"))
    h.tiers = _tier_rates(s0, s1, dt)
    h.breakers = _breakers(s1)
    h.cache_hit, h.cache_host_hit = _cache_hits(s0, s1)
    h.model = _model(s1)
    h.quality = quality(s0, s1)
    h.variants = variant_ctr(s0, s1)
    h.slo = slo_figures(window, slo or SloSettings())
    return h


def _window(s0: Samples, s1: Samples, t0: float, t1: float, name: str) -> Samples:
    """Series ``name`` over the window between two scrapes (the newest alone when they are
    the same scrape)."""
    return subtract(s1, s0, name) if t1 > t0 else {name: s1.get(name, [])}


def _rate(s0: Samples, s1: Samples, dt: float, name: str, **match: str) -> float:
    return round(max(total(s1, name, **match) - total(s0, name, **match), 0.0) / dt, 1)


def _freshness(window: Samples, hot: Samples) -> tuple[dict, dict]:
    """Freshness p50 and p99 per stage of the lag histograms, and of the hot list, in ms."""
    p50: dict[str, float | None] = {}
    p99: dict[str, float | None] = {}
    for stage in STAGES:
        p50[stage] = _ms(histogram_quantile(window, LAG, 0.5, stage=stage))
        p99[stage] = _ms(histogram_quantile(window, LAG, 0.99, stage=stage))
    p50["hot_list"] = _ms(histogram_quantile(hot, "freshrec_hot_list_lag_seconds", 0.5))
    p99["hot_list"] = _ms(histogram_quantile(hot, "freshrec_hot_list_lag_seconds", 0.99))
    return p50, p99


def _consumer_lag(s1: Samples) -> dict[str, float]:
    """Messages behind per ``group/topic``, over every partition and service."""
    lag: dict[str, float] = {}
    for labels, v in s1.get("freshrec_consumer_lag_messages", []):
        key = f"{labels.get('group', '?')}/{labels.get('topic', '?')}"
        lag[key] = lag.get(key, 0.0) + v
    return lag


def _rates(s0: Samples, s1: Samples, dt: float) -> dict[str, float]:
    def rate(name: str, **match: str) -> float:
        return _rate(s0, s1, dt, name, **match)

    return {
        "events_counted": rate("freshrec_streams_counted_events_total"),
        "events_learnt": rate("freshrec_worker_events_total", outcome="valid"),
        "dead_letters": rate("freshrec_dead_letters_total"),
        "requests_served": rate("freshrec_requests_total", outcome="served"),
        "requests_expired": rate("freshrec_requests_total", outcome="expired"),
        "gradient_rows": rate("freshrec_gradient_rows_total", outcome="sent"),
        "rows_applied": rate("freshrec_ps_rows_applied_total"),
        "updates_installed": rate("freshrec_updates_installed_total", outcome="installed"),
    }


def _latency(rw: Samples) -> dict[str, float | None]:
    """p99 of each request stage and p50 of the whole request over the window, in ms."""
    req = "freshrec_request_seconds"
    latency = {
        f"{stage}_p99": _ms(histogram_quantile(rw, req, 0.99, stage=stage))
        for stage in REQUEST_STAGES
    }
    latency["total_p50"] = _ms(histogram_quantile(rw, req, 0.5, stage="total"))
    return latency


def _tier_rates(s0: Samples, s1: Samples, dt: float) -> dict[str, float]:
    tiers = {}
    for labels, _ in s1.get("freshrec_replies_total", []):
        tier = labels.get("tier", "?")
        tiers[tier] = _rate(s0, s1, dt, "freshrec_replies_total", tier=tier)
    return tiers


def _breakers(s1: Samples) -> dict[str, str]:
    names = {0.0: "closed", 1.0: "half_open", 2.0: "open"}
    return {
        labels.get("channel", "?"): names.get(v, str(v))
        for labels, v in s1.get("freshrec_breaker_state", [])
    }


def _cache_hits(s0: Samples, s1: Samples) -> tuple[float | None, float | None]:
    """The shares of the window's embedding lookups the device and host RAM held."""
    lookups = {
        tier: total(s1, "freshrec_cache_lookups_total", tier=tier)
        - total(s0, "freshrec_cache_lookups_total", tier=tier)
        for tier in ("device", "host", "redis", "new")
    }
    n = sum(lookups.values())
    return (
        round(lookups["device"] / n, 4) if n > 0 else None,
        round(lookups["host"] / n, 4) if n > 0 else None,
    )


def _model(s1: Samples) -> str | None:
    """The model version the services report serving (the last one listed)."""
    model = None
    for labels, v in s1.get("freshrec_model_info", []):
        if v:
            model = labels.get("version")
    return model


FEEDBACK = "freshrec_feedback_events_total"


def quality(s0: Samples, s1: Samples) -> dict[str, float | None]:
    """CTR and CVR of served recommendations between two scrapes: overall over the replies
    a worker knows it served, and per tier (``unknown`` too: events naming a request no
    worker remembers, such as a simulator's or another system's)."""

    def d(**match: str) -> float:
        return max(total(s1, FEEDBACK, **match) - total(s0, FEEDBACK, **match), 0.0)

    def served(event_type: str) -> float:  # replies a worker knows it served
        return d(event_type=event_type) - d(event_type=event_type, tier="unknown")

    def share(a: float, b: float) -> float | None:
        return round(a / b, 4) if b > 0 else None

    out = {
        "ctr": share(served("click"), served("impression")),
        "cvr": share(served("conversion"), served("click")),
    }
    for tier in sorted({labels.get("tier", "?") for labels, _ in s1.get(FEEDBACK, [])}):
        out[f"ctr_{tier}"] = share(
            d(event_type="click", tier=tier), d(event_type="impression", tier=tier)
        )
    return out


EXPERIMENT_EVENTS = "freshrec_experiment_events_total"


def variant_ctr(s0: Samples, s1: Samples) -> dict[str, float | None]:
    """CTR per ``experiment/variant`` between two scrapes (events naming replies that had a
    variant; the unattributed ones are left out).

    >>> from freshrec.promtext import parse
    >>> row = 'freshrec_experiment_events_total{{experiment="e",variant="{}",event_type="{}"}} {}'
    >>> s1 = parse("\\n".join(row.format(*x) for x in [("a", "impression", 10), ("a", "click", 3)]))
    >>> variant_ctr({}, s1)
    {'e/a': 0.3}
    """
    names = sorted(
        {
            (labels.get("experiment", ""), labels.get("variant", ""))
            for labels, _ in s1.get(EXPERIMENT_EVENTS, [])
            if labels.get("experiment")
        }
    )

    def d(exp: str, variant: str, kind: str) -> float:
        match = {"experiment": exp, "variant": variant, "event_type": kind}
        return max(total(s1, EXPERIMENT_EVENTS, **match) - total(s0, EXPERIMENT_EVENTS, **match), 0)

    out = {}
    for exp, variant in names:
        shown = d(exp, variant, "impression")
        out[f"{exp}/{variant}"] = round(d(exp, variant, "click") / shown, 4) if shown else None
    return out


def late_share(window: Samples, stage: str, bound_s: float) -> float | None:
    """The share of a stage's lag observations in ``window`` above ``bound_s`` (a bucket
    bound); None without observations."""
    within = every = 0.0
    for labels, v in window.get(LAG + "_bucket", []):
        if labels.get("stage") != stage:
            continue
        le = float(labels.get("le", "nan"))
        if le == math.inf:
            every += v
        elif abs(le - bound_s) < 1e-9:
            within += v
    return round(1 - within / every, 5) if every > 0 else None


def slo_figures(window: Samples, slo: SloSettings) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for stage, bound in (("served", slo.served_s), ("reply", slo.reply_s)):
        late = late_share(window, stage, bound)
        out[f"{stage}_late"] = late
        out[f"{stage}_burn"] = None if late is None else round(burn_rate(late, slo.target), 2)
    return out


class Poller:
    """Samples an ``Observer`` every ``interval_s`` on a daemon thread."""

    def __init__(self, observer: Observer, interval_s: float = 1.0) -> None:
        self.observer = observer
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="observer")

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.observer.sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
