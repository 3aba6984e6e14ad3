"""What ``freshrec replay`` writes: the arms' table on stdout, ``replay.csv`` (one row per
arm), ``replay_windows.csv`` (one row per arm and time window), ``replay.json`` (all of it,
with the settings), ``replay_interactions.csv.gz`` (each scored interaction's HR and NDCG
per arm: ``tools/replay_diff.py`` pairs two replays' on the same interactions) and
``replay_hr.png`` (HR@k per window, one line per arm)."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

COLUMNS = ("arm", "kind", "hr", "ndcg", "mrr", "recall", "coverage", "interactions", "wall_s")


def table(rows: list[dict], k: int) -> str:
    w = max([12, *(len(r["arm"]) for r in rows)])
    head = (
        f"{'arm':<{w}} {'kind':<9} {f'HR@{k}':>8} {f'NDCG@{k}':>8} {f'MRR@{k}':>8} "
        f"{f'recall@{k}':>9} {'coverage':>8} {'evaluated':>9} {'wall s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:

        def f(key: str, r: dict = r) -> str:
            v = r.get(key)
            return "-" if v is None else f"{v:.4f}"

        lines.append(
            f"{r['arm']:<{w}} {r['kind']:<9} {f('hr'):>8} {f('ndcg'):>8} {f('mrr'):>8} "
            f"{f('recall'):>9} {f('coverage'):>8} {r['interactions']:>9,} {r['wall_s']:>7}"
        )
    return "\n".join(lines)


def paired(live: list, baselines: list) -> list[dict]:
    """Each live arm minus each baseline (and minus ``frozen``), and ``full`` minus each of
    its ablations (``full-without-…``: what that channel is worth), HR and NDCG, on the same
    interactions, with 95% intervals clustered by user (``evaluation.metrics``)."""
    from evaluation.metrics import paired_difference

    out = []
    frozen = [s for s in live if s.name == "frozen"]
    ablated = [s for s in live if s.name.startswith("full-without-")]
    for arm in live:
        others = [*baselines, *(f for f in frozen if arm.name != "frozen")]
        if arm.name == "full":
            others += ablated
        for base in others:
            row = {"arm": arm.name, "against": base.name}
            for metric in ("hr", "ndcg"):
                d = paired_difference(arm, base, metric)
                row.update(
                    {metric: d["diff"], f"{metric}_low": d["low"], f"{metric}_high": d["high"]}
                )
            row["interactions"], row["users"] = d["interactions"], d["users"]
            out.append(row)
    return out


def paired_table(rows: list[dict], k: int) -> str:
    """``arm − baseline`` with intervals; ``*`` marks an interval above zero."""
    wide = max([12, *(len(r["against"]) + 1 for r in rows)])
    arm_w = max([8, *(len(r["arm"]) for r in rows)])
    head = (
        f"{'arm':<{arm_w}} {'minus':<{wide}} {f'HR@{k} diff (95% CI)':<30} "
        f"{f'NDCG@{k} diff (95% CI)':<30}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:

        def cell(m: str, r: dict = r) -> str:
            if r[m] is None:
                return "-"
            mark = " *" if r[f"{m}_low"] > 0 else ""
            return f"{r[m]:+.4f} ({r[f'{m}_low']:+.4f}..{r[f'{m}_high']:+.4f}){mark}"

        lines.append(
            f"{r['arm']:<{arm_w}} {r['against']:<{wide}} {cell('hr'):<30} {cell('ndcg'):<30}"
        )
    return "\n".join(lines)


def history_table(rows: dict[str, dict], k: int, whose: str = "earlier") -> str:
    """HR@k per arm for users (or items) with 0, 1-9, 10-99 and 100+ earlier interactions
    (with how many interactions each bucket holds)."""
    from evaluation.metrics import HISTORY_BUCKETS

    names = [name for _, _, name in HISTORY_BUCKETS]
    head = f"{f'HR@{k} by {whose} interactions':<32}" + "".join(f"{n:>14}" for n in names)
    lines = [head, "-" * len(head)]
    counts = next(iter(rows.values()), {})
    lines.append(
        f"{'(interactions)':<32}"
        + "".join(f"{counts.get(n, {}).get('interactions', 0):>14,}" for n in names)
    )
    for arm, buckets in rows.items():
        cells = "".join(
            f"{'-' if buckets[n]['hr'] is None else format(buckets[n]['hr'], '.4f'):>14}"
            for n in names
        )
        lines.append(f"{arm:<32}{cells}")
    return "\n".join(lines)


INTERACTIONS = "replay_interactions.csv.gz"


def write_interactions(path: Path, arms: list) -> Path:
    """Each arm's (``ArmScores``) per-interaction HR and NDCG, with the user and log position,
    in the replay's order: what a paired comparison of two replays reads."""
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "user", "position", "hr", "ndcg"])
        for s in arms:
            positions = s.positions or [-1] * len(s.users)
            for row in zip(
                s.users, positions, s.per_interaction["hr"], s.per_interaction["ndcg"], strict=True
            ):
                w.writerow([s.name, *row])
    return path


def read_interactions(path: Path, arm: str):
    """Arm ``arm``'s scores from ``write_interactions``' file, as an ``ArmScores`` that
    ``evaluation.metrics.paired_difference`` takes (KeyError: no such arm in it)."""
    from evaluation.metrics import ArmScores

    s = ArmScores(arm)
    with gzip.open(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            if r["arm"] == arm:
                s.users.append(r["user"])
                s.positions.append(int(r["position"]))
                s.per_interaction["hr"].append(float(r["hr"]))
                s.per_interaction["ndcg"].append(float(r["ndcg"]))
    if not s.users:
        raise KeyError(f"{path} holds no interactions of arm {arm!r}")
    return s


def write(
    out: Path, rows: list[dict], windows: list[dict], meta: dict, k: int, arms: list = ()
) -> list[Path]:
    """The files, in ``out`` (``arms``: the ``ArmScores`` whose interactions are kept);
    returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    summary, per_window = out / "replay.csv", out / "replay_windows.csv"
    with summary.open("w", newline="") as f:
        w = csv.DictWriter(f, [*COLUMNS, "notes"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with per_window.open("w", newline="") as f:
        w = csv.DictWriter(f, ["arm", "window", "from_ms", "hr", "ndcg", "mrr", "recall"])
        w.writeheader()
        w.writerows(windows)
    report = out / "replay.json"
    report.write_text(json.dumps({**meta, "arms": rows, "windows": windows}, indent=1) + "\n")
    scores = write_interactions(out / INTERACTIONS, list(arms))
    return [summary, per_window, report, scores, plot(out / "replay_hr.png", windows, k, meta)]


def plot(path: Path, windows: list[dict], k: int, meta: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for arm in dict.fromkeys(w["arm"] for w in windows):
        pts = [(w["window"], w["hr"]) for w in windows if w["arm"] == arm and w["hr"] is not None]
        if pts:
            style = "-" if arm in ("frozen", "local", "full") else "--"
            ax.plot(*zip(*pts, strict=True), style, marker="o", markersize=3, label=arm)
    ax.set_xlabel("time window of the replayed part (equal event time)")
    ax.set_ylabel(f"HR@{k}")
    ax.set_title(f"{meta.get('log', 'replay')}: HR@{k} per window", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
