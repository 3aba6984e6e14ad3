"""``freshrec experiments report``: per variant of each A/B experiment, requests,
impressions, clicks, conversions, CTR and CVR with 95% intervals at the user level, the
serving time per 1,000 requests, and the guard's comparison with the control — superiority
and non-inferiority of the CTR, and a verdict (``freshcore.abstats``) — from what the workers
and the streams app counted in Redis."""

from __future__ import annotations

import json
import math

from freshcore.abstats import (
    ANALYSIS_BUCKETS,
    MIN_SAVING,
    NON_INFERIORITY_MARGIN,
    Ratio,
    compare,
    ratio,
)
from freshcore.rediskeys import RedisKeys

KINDS = ("requests", "impression", "click", "conversion")


def variant_rows(
    meta: dict[str, str],
    counts: dict[str, int],
    margin: float = NON_INFERIORITY_MARGIN,
    min_saving: float = MIN_SAVING,
) -> dict:
    """The report of one experiment from its ``exp:{name}`` hash and its counts (pure):
    totals ``{variant}:{kind}``, per analysis bucket ``{variant}:{kind}:{bucket}``, serving
    time ``{variant}:cost_us``.

    >>> meta = {"variants": '["a", "b"]', "shares": "[0.5, 0.5]", "control": "a"}
    >>> counts = {f"{v}:{k}:{b}": n for b in range(64)
    ...           for v, k, n in [("a", "impression", 100), ("a", "click", 10 + b % 3),
    ...                           ("b", "impression", 100), ("b", "click", 13 + b % 3)]}
    >>> rep = variant_rows(meta, counts)
    >>> b = rep["variants"][1]
    >>> b["variant"], round(b["vs_control"]["ctr_relative"], 2), b["vs_control"]["verdict"]
    ('b', 0.27, 'better')
    """
    names = json.loads(meta["variants"])
    shares = json.loads(meta.get("shares", "[]")) or [None] * len(names)
    control = meta.get("control", names[0])
    rows, rates = [], {}
    for name, share in zip(names, shares, strict=True):
        row, rates[name] = _variant_row(name, share, counts)
        rows.append(row)
    base = next(r for r in rows if r["variant"] == control)
    for r in rows:
        if r is not base:
            r["vs_control"] = _vs_control(
                rates[r["variant"]], rates[control], r, base, margin, min_saving
            )
    return {
        "control": control,
        "margin": margin,
        "min_saving": min_saving,
        "analysis_buckets": ANALYSIS_BUCKETS,
        "variants": rows,
    }


def _variant_row(name: str, share: float | None, counts: dict[str, int]) -> tuple[dict, Ratio]:
    """One variant's row of the report (its totals, CTR and CVR with their intervals, its
    serving time), and its CTR over the analysis buckets, which the guard compares."""
    per = {
        k: [int(counts.get(f"{name}:{k}:{b}", 0)) for b in range(ANALYSIS_BUCKETS)] for k in KINDS
    }
    c = {k: int(counts.get(f"{name}:{k}", 0)) for k in KINDS}
    imp, clk, conv = c["impression"], c["click"], c["conversion"]
    ctr = ratio(per["click"], per["impression"])
    cvr = ratio(per["conversion"], per["click"])
    cost_us = int(counts.get(f"{name}:cost_us", 0))
    row = {
        "variant": name,
        "share": share,
        "requests": c["requests"],
        "impressions": imp,
        "clicks": clk,
        "conversions": conv,
        "ctr": clk / imp if imp else None,
        "ctr_ci95": _interval(ctr),
        "cvr": conv / clk if clk else None,
        "cvr_ci95": _interval(cvr),
        "user_buckets": ctr.buckets,
        # seconds of serving work per 1,000 requests: µs per request / 1,000
        "serving_s_per_1k": cost_us / c["requests"] / 1000 if c["requests"] else None,
        "inconsistent": _inconsistent(imp, clk, conv),
    }
    return row, ctr


def _vs_control(
    ctr: Ratio, control_ctr: Ratio, row: dict, base: dict, margin: float, min_saving: float
) -> dict:
    """A variant's comparison with the control (``freshcore.abstats.compare``), as reported."""
    g = compare(
        ctr,
        control_ctr,
        row["serving_s_per_1k"],
        base["serving_s_per_1k"],
        margin=margin,
        min_saving=min_saving,
    )
    return {
        "ctr_diff": _num(g.diff),
        "ctr_diff_ci95": _pair(g.diff_ci),
        "ctr_relative": _num(g.relative),
        "ctr_relative_ci95": _pair(g.relative_ci),
        "non_inferior": g.non_inferior,
        "cheaper": g.cheaper,
        "verdict": g.verdict,
    }


def _inconsistent(impressions: int, clicks: int, conversions: int) -> str | None:
    """Why a variant's counts are not proportions (no interval or test is given for them)."""
    why = []
    if clicks > impressions:
        why.append(f"{clicks:,} clicks > {impressions:,} impressions")
    if conversions > clicks:
        why.append(f"{conversions:,} conversions > {clicks:,} clicks")
    return "; ".join(why) or None


def _interval(r: Ratio) -> list[float] | None:
    return _pair(r.interval())


def _pair(p: tuple[float, float]) -> list[float] | None:
    return None if math.isnan(p[0]) or math.isnan(p[1]) else [p[0], p[1]]


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def read(
    r, keys: RedisKeys, names: list[str] | None = None, margin: float = NON_INFERIORITY_MARGIN
) -> dict[str, dict]:
    """Each experiment's report (all that workers have run, or ``names``)."""
    if not names:
        names = sorted(n.decode() for n in r.smembers(keys.experiments))
    out = {}
    for name in names:
        meta = {k.decode(): v for k, v in r.hgetall(keys.experiment(name)).items()}
        if "variants" not in meta:
            raise KeyError(f"no experiment {name!r} in Redis (run workers with it first)")
        meta = {k: v.decode() for k, v in meta.items() if k != "table"}
        counts = {k.decode(): int(v) for k, v in r.hgetall(keys.experiment_counts(name)).items()}
        out[name] = variant_rows(meta, counts, margin=margin)
    return out


def read_from(
    conn, names: list[str] | None = None, margin: float = NON_INFERIORITY_MARGIN
) -> dict[str, dict]:
    """``read`` on the Redis of ``conn`` (its own connection, closed after)."""
    from freshcore.redisconn import connect

    r = connect(conn.redis_url)
    try:
        return read(r, RedisKeys(conn.topic_prefix), names, margin)
    finally:
        r.close()


def render(reports: dict[str, dict]) -> str:
    """A table per experiment, and each variant's verdict against the control."""
    if not reports:
        return "no experiments have run (set FRESHREC_EXPERIMENTS_FILE on the workers)"
    out = []
    for name, rep in reports.items():
        out.append(f"experiment {name} (control: {rep['control']})")
        out.append(
            f"  {'variant':<14} {'share':>6} {'requests':>9} {'impr.':>8} {'clicks':>7} "
            f"{'conv.':>6}  {'CTR [95% CI]':<24} {'CVR [95% CI]':<24} {'serving s/1k':>12}"
        )
        for v in rep["variants"]:
            share = "–" if v["share"] is None else f"{v['share']:.1%}"
            cost = "–" if v["serving_s_per_1k"] is None else f"{v['serving_s_per_1k']:.3f}"
            out.append(
                f"  {v['variant']:<14} {share:>6} {v['requests']:>9,} {v['impressions']:>8,} "
                f"{v['clicks']:>7,} {v['conversions']:>6,}  "
                f"{_rate(v['ctr'], v['ctr_ci95']):<24} {_rate(v['cvr'], v['cvr_ci95']):<24} "
                f"{cost:>12}"
            )
            if v.get("inconsistent"):
                out.append(f"  {'':<14} counts are not proportions: {v['inconsistent']}")
        out.append(
            f"  vs {rep['control']} (CTR, relative; users in {rep['analysis_buckets']} buckets; "
            f"non-inferiority margin {rep['margin']:.0%}):"
        )
        for v in rep["variants"]:
            vs = v.get("vs_control")
            if vs is None:
                continue
            rel, ci = vs["ctr_relative"], vs["ctr_relative_ci95"]
            change = (
                "–" if rel is None or ci is None else f"{rel:+.1%} [{ci[0]:+.1%}, {ci[1]:+.1%}]"
            )
            out.append(f"  {v['variant']:<14} {change:<28} {vs['verdict']}")
    return "\n".join(out)


def _rate(p: float | None, ci: list[float] | None) -> str:
    if p is None or ci is None:
        return "–"
    return f"{p:.2%} [{ci[0]:.2%}, {ci[1]:.2%}]"
