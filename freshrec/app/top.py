"""``freshrec top``: the dashboard's headline figures as a compact table in the terminal."""

from __future__ import annotations

import sys
import time

from freshrec.app.observe import Headline, Observer


def _f(v, unit: str = "") -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}{unit}" if abs(v) >= 100 else f"{v:,.1f}{unit}"


def render(h: Headline) -> str:
    lines = [time.strftime("freshrec top — %H:%M:%S", time.localtime(h.t))]
    lines.append(
        "services   " + "  ".join(f"{n}:{'up' if ok else 'DOWN'}" for n, ok in h.up.items())
    )
    lines.append(f"{'freshness':<11}{'p50':>10}{'p99':>10}")
    for stage in ("local", "global_applied", "served", "reply", "hot_list"):
        lines.append(
            f"  {stage:<9}{_f(h.freshness_p50_ms.get(stage), 'ms'):>10}"
            f"{_f(h.freshness_p99_ms.get(stage), 'ms'):>10}"
        )
    behind = "  ".join(
        f"{stage} {'–' if v is None else f'{v:.2f} s'}" for stage, v in h.behind_s.items()
    )
    lines.append(f"{'behind':<11}{behind or '–'}  (event time, vs what the workers learnt)")
    r = h.rates
    lines.append(
        f"events/s   counted {_f(r.get('events_counted'))}  learnt {_f(r.get('events_learnt'))}"
        f"  dead letters {_f(r.get('dead_letters'))}"
    )
    lines.append(
        f"rows/s     gradients {_f(r.get('gradient_rows'))}  applied {_f(r.get('rows_applied'))}"
        f"  installed {_f(r.get('updates_installed'))}"
    )
    lat = h.latency_ms
    lines.append(
        f"requests/s {_f(r.get('requests_served'))}  latency p50 {_f(lat.get('total_p50'), 'ms')}"
        f" p99 {_f(lat.get('total_p99'), 'ms')}  expired/s {_f(r.get('requests_expired'))}"
    )
    if h.tiers:
        lines.append("tiers/s    " + "  ".join(f"{t} {_f(v)}" for t, v in sorted(h.tiers.items())))
    if h.breakers:
        lines.append("breakers   " + "  ".join(f"{c}:{s}" for c, s in sorted(h.breakers.items())))
    q = h.quality
    tiers = "  ".join(f"{k[4:]} {_pct(v)}" for k, v in q.items() if k.startswith("ctr_"))
    lines.append(
        f"quality    CTR {_pct(q.get('ctr'))}  CVR {_pct(q.get('cvr'))}"
        + (f"  (CTR by tier: {tiers})" if tiers else "")
    )
    if h.variants:
        lines.append(
            "variants   CTR " + "  ".join(f"{k} {_pct(v)}" for k, v in sorted(h.variants.items()))
        )
    slo = h.slo
    lines.append(
        f"SLO        served late {_pct(slo.get('served_late'))} burn {_f(slo.get('served_burn'))}"
        f"  reply late {_pct(slo.get('reply_late'))} burn {_f(slo.get('reply_burn'))}"
    )
    lag = "  ".join(f"{k} {_f(v)}" for k, v in sorted(h.consumer_lag.items()))
    lines.append(f"lag        {lag or '–'}")
    lines.append(
        f"cache hit  device {_pct(h.cache_hit)} host {_pct(h.cache_host_hit)}"
        f"   model {h.model or '–'}"
    )
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def run_top(observer: Observer, interval_s: float = 1.0, iterations: int | None = None) -> None:
    tty = sys.stdout.isatty()
    n = 0
    while iterations is None or n < iterations:
        started = time.monotonic()
        text = render(observer.sample())
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            sys.stdout.write(text + "\n\n")
        sys.stdout.flush()
        n += 1
        if iterations is None or n < iterations:
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
