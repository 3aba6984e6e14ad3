"""The figures and the report of ``tools/bench_freshness.py``: an arm's figures from its
closed loop's statistics, the one-line summary of each arm, the CTR table per window, the
drifted users' recovery against the frozen arm, and the plot of the CTR curves."""

from __future__ import annotations

from pathlib import Path

from evaluation.drift import Recovery, level_before, recovery_s
from freshrec.sim.closedloop import LoopStats

GROUPS = ("steady", "drifted")


def arm_result(stats: LoopStats, drift_s: float, end_s: float) -> dict:
    """The arm's figures; windows that start at ``end_s`` or later (replies still in flight
    when the loop stopped) are left out."""
    w, span = stats.windows, stats.windows.window_s
    return {
        "requests": stats.sent,
        "replied": stats.replied,
        "timeouts": stats.timeouts,
        "latency_p50_ms": round(stats.p(50, False), 1),
        "latency_p99_ms": round(stats.p(99, False), 1),
        "ctr": round(stats.ctr, 4),
        "ctr_by_tier": stats.tier_ctr(),
        "groups": {
            g: {
                "first_window": w.ctr(g, 0.0, span),
                "last_window_before_drift": w.ctr(g, drift_s - span, drift_s),
                "first_window_after_drift": w.ctr(g, drift_s, drift_s + span),
                "last_window": w.ctr(g, end_s - span, end_s),
                "curve": [c for c in w.curve(g) if c["from_s"] < end_s],
            }
            for g in GROUPS
        },
        "curve": [c for c in w.curve() if c["from_s"] < end_s],
    }


def summary_line(r: dict) -> str:
    s, d = r["groups"]["steady"], r["groups"]["drifted"]
    return (
        f"CTR {100 * r['ctr']:.1f}% (steady users: first window {_pct(s['first_window'])},"
        f" last {_pct(s['last_window'])}); around the drift, drifted users"
        f" {_pct(d['last_window_before_drift'])} → {_pct(d['first_window_after_drift'])},"
        f" steady {_pct(s['last_window_before_drift'])} → {_pct(s['first_window_after_drift'])};"
        f" request p99 {r['latency_p99_ms']} ms"
        + (
            f"; the cohort's ten best items by u·v: {_pct(q['start']['rows_top10_ctr'])} at the"
            f" start, {_pct(q['end']['rows_top10_ctr'])} at the end (truly best ten:"
            f" {_pct(q['end']['ideal_top10_ctr'])}); among the"
            f" {q['end'].get('shown_items', 0):,} items shown:"
            f" {_pct(q['end'].get('rows_top10_shown_ctr'))}"
            f" (truly best: {_pct(q['end'].get('ideal_top10_shown_ctr'))})"
            if (q := r.get("rows"))
            else ""
        )
    )


def table(arms: dict, window_s: float) -> str:
    """The cohort's CTR per window (rows) for each arm (columns), as Markdown."""
    starts = sorted({c["from_s"] for a in arms for c in arms[a]["curve"]})
    lines = ["| window (s) | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for start in starts:
        cells = []
        for a in arms:
            hit = [c for c in arms[a]["curve"] if c["from_s"] == start]
            cells.append(_pct(hit[0]["ctr"]) if hit else "")
        lines.append(f"| {start:.0f}–{start + window_s:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recoveries(arms: dict, drift_s: float, window_s: float) -> dict:
    """Per arm, for the users who drift: the CTR level before the drift (the last three
    windows), the time after it until a window is back to 80% of that, and how much sooner
    than the frozen arm (when one ran) that was."""
    out = {}
    for name, r in arms.items():
        curve = r["groups"]["drifted"]["curve"]
        level = level_before(curve, drift_s, window_s)
        out[name] = {
            "ctr_before": None if level is None else round(level, 4),
            "all_ctr_before": level_before(r["curve"], drift_s, window_s),
            "recovery_s": recovery_s(curve, drift_s, window_s),
        }
    frozen = [n for n in arms if n.split(" #")[0] == "frozen"]
    for name, r in out.items():
        if frozen and name not in frozen:
            reference = out[frozen[0]]["recovery_s"]
            r["speedup_vs_frozen"] = Recovery(r["recovery_s"], reference).speedup
    return out


def recovery_lines(rec: dict) -> str:
    lines = []
    for name, r in rec.items():
        back = "never" if r["recovery_s"] is None else f"after {r['recovery_s']:.0f} s"
        speed = r.get("speedup_vs_frozen")
        vs = "" if speed is None else f" ({speed:.1f}× as fast as frozen)"
        lines.append(
            f"{name}: drifted users' CTR before the drift {_pct(r['ctr_before'])}, back to"
            f" 80% of it {back}{vs}"
        )
    return "\n".join(lines)


def plot(path: Path, arms: dict, drift_s: float, window_s: float) -> Path:
    """The drifted users' CTR per window, one line per arm, the drift marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, r in arms.items():
        for group, style in (("drifted", "-"), ("steady", ":")):
            pts = [
                (c["from_s"] + window_s / 2, 100 * c["ctr"])
                for c in r["groups"][group]["curve"]
                if c["ctr"] is not None
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=f"{name} {group}")
    ax.axvline(drift_s, color="grey", lw=1)
    ax.set_xlabel("seconds since the first request (the drift at the grey line)")
    ax.set_ylabel("CTR (%) per window")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"
