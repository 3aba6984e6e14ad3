"""``freshrec experiments report``: per variant of each A/B experiment, requests,
impressions, clicks, conversions, CTR and CVR with 95% intervals, and the CTR's two-proportion
test against the control — from what the workers and the streams app counted in Redis."""

from __future__ import annotations

import json
import math

from freshrec.abstats import two_proportions, wilson
from freshrec.rediskeys import RedisKeys

KINDS = ("requests", "impression", "click", "conversion")


def variant_rows(meta: dict[str, str], counts: dict[str, int]) -> dict:
    """The report of one experiment from its ``exp:{name}`` hash and its counts (pure).

    >>> meta = {"variants": '["a", "b"]', "shares": "[0.5, 0.5]", "control": "a"}
    >>> counts = {"a:impression": 400, "a:click": 40, "b:impression": 400, "b:click": 60}
    >>> rep = variant_rows(meta, counts)
    >>> [(v["variant"], v["ctr"], round(v["vs_control"]["p"], 4)) for v in rep["variants"][1:]]
    [('b', 0.15, 0.0325)]
    """
    names = json.loads(meta["variants"])
    shares = json.loads(meta.get("shares", "[]")) or [None] * len(names)
    control = meta.get("control", names[0])
    rows = []
    for name, share in zip(names, shares, strict=True):
        c = {k: int(counts.get(f"{name}:{k}", 0)) for k in KINDS}
        imp, clk, conv = c["impression"], c["click"], c["conversion"]
        rows.append(
            {
                "variant": name,
                "share": share,
                "requests": c["requests"],
                "impressions": imp,
                "clicks": clk,
                "conversions": conv,
                "ctr": clk / imp if imp else None,
                "ctr_ci95": _interval(clk, imp),
                "cvr": conv / clk if clk else None,
                "cvr_ci95": _interval(conv, clk),
                "inconsistent": _inconsistent(imp, clk, conv),
            }
        )
    base = next(r for r in rows if r["variant"] == control)
    for r in rows:
        if r is not base:
            t = two_proportions(r["clicks"], r["impressions"], base["clicks"], base["impressions"])
            r["vs_control"] = {"ctr_diff": _num(t.diff), "z": _num(t.z), "p": _num(t.p)}
    return {"control": control, "variants": rows}


def _inconsistent(impressions: int, clicks: int, conversions: int) -> str | None:
    """Why a variant's counts are not proportions (no interval or test is given for them)."""
    why = []
    if clicks > impressions:
        why.append(f"{clicks:,} clicks > {impressions:,} impressions")
    if conversions > clicks:
        why.append(f"{conversions:,} conversions > {clicks:,} clicks")
    return "; ".join(why) or None


def _interval(x: int, n: int) -> list[float] | None:
    lo, hi = wilson(x, n)
    return None if math.isnan(lo) else [lo, hi]


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def read(r, keys: RedisKeys, names: list[str] | None = None) -> dict[str, dict]:
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
        out[name] = variant_rows(meta, counts)
    return out


def read_from(conn, names: list[str] | None = None) -> dict[str, dict]:
    """``read`` on the Redis of ``conn`` (its own connection, closed after)."""
    from freshrec.redisconn import connect

    r = connect(conn.redis_url)
    try:
        return read(r, RedisKeys(conn.topic_prefix), names)
    finally:
        r.close()


def render(reports: dict[str, dict]) -> str:
    """A table per experiment."""
    if not reports:
        return "no experiments have run (set FRESHREC_EXPERIMENTS_FILE on the workers)"
    out = []
    for name, rep in reports.items():
        out.append(f"experiment {name} (control: {rep['control']})")
        out.append(
            f"  {'variant':<14} {'share':>6} {'requests':>9} {'impr.':>8} {'clicks':>7} "
            f"{'conv.':>6}  {'CTR [95% CI]':<24} {'vs control':<22} {'CVR [95% CI]'}"
        )
        for v in rep["variants"]:
            share = "–" if v["share"] is None else f"{v['share']:.1%}"
            vs = v.get("vs_control")
            if vs is None:
                versus = "control"
            elif vs["p"] is None:
                versus = "–"
            else:
                versus = f"{vs['ctr_diff']:+.2%} (p={vs['p']:.3g})"
            out.append(
                f"  {v['variant']:<14} {share:>6} {v['requests']:>9,} {v['impressions']:>8,} "
                f"{v['clicks']:>7,} {v['conversions']:>6,}  "
                f"{_rate(v['ctr'], v['ctr_ci95']):<24} {versus:<22} "
                f"{_rate(v['cvr'], v['cvr_ci95'])}"
            )
            if v.get("inconsistent"):
                out.append(f"  {'':<14} counts are not proportions: {v['inconsistent']}")
    return "\n".join(out)


def _rate(p: float | None, ci: list[float] | None) -> str:
    if p is None or ci is None:
        return "–"
    return f"{p:.2%} [{ci[0]:.2%}, {ci[1]:.2%}]"
