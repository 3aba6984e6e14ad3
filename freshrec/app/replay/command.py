"""What ``freshrec replay`` does, in order: read the log and plan the replay, run the live
arms (after ``--tune``, if asked), score the baselines, then write and print the report."""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from evaluation.metrics import by_history
from freshcore.settings import state_dir
from freshrec.app.replay.baselines import choice_margin, run_baseline
from freshrec.progress import ProgressLine


@dataclass
class ReplayResults:
    """What the arms and baselines scored, as the report takes it: a row per arm, a row per
    arm and window, each arm's ``ArmScores`` (live and baseline), and each arm's details."""

    t_ms: object
    """The log's event times (``numpy``): a window's rows say when it starts."""
    train_end: int
    windows_n: int
    catalogue: int
    """Items of the log and the item file: what coverage is a share of."""
    rows: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)
    live: list = field(default_factory=list)
    baselines: dict[str, object] = field(default_factory=dict)
    """Baseline -> its ``ArmScores``, for the paired differences."""
    details: dict[str, dict] = field(default_factory=dict)

    def record(self, kind: str, scores, wall_s: float, notes: str = "") -> None:
        row = {**scores.summary(self.catalogue), "kind": kind, "wall_s": wall_s, "notes": notes}
        self.rows.append(row)
        t0 = int(self.t_ms[self.train_end])
        span = max(int(self.t_ms[-1]) - t0, 1)
        for w in scores.window_rows():
            self.windows.append({**w, "from_ms": t0 + span * w["window"] // self.windows_n})

    @property
    def scored(self) -> list:
        """Every arm's ``ArmScores``: the live ones, then the baselines."""
        return [*self.live, *self.baselines.values()]


def cmd_replay(args: argparse.Namespace) -> int:
    from freshrec.app.options import read_log_from_args
    from freshrec.app.replay.data import prepare

    arms = [a for a in args.arms.split(",") if a]
    if args.ablate:
        from freshrec.app.replay.arms import ablations

        arms += [a for a in ablations() if a not in arms]
    baselines = [b for b in args.baselines.split(",") if b]
    _check_arms(arms)
    overrides = _overrides(args.settings)
    broker = _broker(arms)
    progress = ProgressLine()
    inter, items = read_log_from_args(args, args.path, progress)
    p = _plan(inter, args)
    out = Path(args.out or state_dir() / "replay" / Path(args.path).name.split(".")[0])
    out.mkdir(parents=True, exist_ok=True)
    progress.done(
        f"replaying {len(inter) - p.train_end:,} interactions after the first {p.train_end:,} "
        f"in {len(p.steps):,} steps: {p.evaluated:,} evaluated, {p.repeats:,} repeats "
        f"(the user had the item already), {p.unsampled:,} outside the sample"
    )
    data = prepare(inter, items, p, args.windows, args.duration, args.speed, args.catalogue)
    catalogue = len(set(inter.items.tolist()) | set(items.ids))
    results = ReplayResults(inter.t_ms, p.train_end, args.windows, catalogue)
    if arms:
        _run_live(arms, inter, items, p, data, out, args, overrides, results, progress)
    _score_baselines(baselines, data, args, results, progress)
    meta = _meta(args, inter, p, data, results, baselines)
    meta["broker"] = broker
    _report(out, results, meta, args.k)
    return 0


def _broker(arms: list[str]) -> str | None:
    """The live arms' broker, named on the first line as ``freshrec run`` names it (each
    arm's stack makes the same choice); the configured services where they are set, none
    without live arms."""
    from freshrec.app.settings import BROKER
    from freshrec.app.stack import external_services
    from freshrec.app.stack.commands import chosen_broker

    if not arms:
        return None
    if external_services():
        return "external (KAFKA_BOOTSTRAP_SERVERS)"
    return chosen_broker(BROKER.read(os.environ)).name


def _check_arms(arms: list[str]) -> None:
    from freshrec.app.replay.arms import arm_spec

    for arm in arms:
        try:
            arm_spec(arm)
        except KeyError as exc:
            raise SystemExit(f"freshrec replay: {exc.args[0]}") from None


def _overrides(pairs: list[str]) -> dict[str, str]:
    """``--set NAME=VALUE`` as a dict of settings."""
    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"freshrec replay: --set {pair!r}: expected NAME=VALUE")
        overrides[name] = value
    return overrides


def _plan(inter, args: argparse.Namespace):
    """The replay's ``evaluation.protocol.Plan``: the cut, the steps, the sample."""
    from evaluation.protocol import plan as make_plan

    try:
        p = make_plan(
            inter.users,
            inter.items,
            train_share=args.train_share,
            step=args.step,
            sample=args.sample,
            seed=args.seed,
        )
    except ValueError as exc:
        raise SystemExit(f"freshrec replay: {exc}") from None
    if p.train_end == 0 or not p.evaluated:
        raise SystemExit(
            "freshrec replay: nothing to train on or nothing to evaluate: see --train-share"
        )
    return p


def _run_live(arms, inter, items, p, data, out: Path, args, overrides, results, progress) -> None:
    """Each live arm through the pipeline, with the starting models trained on the training
    part and the settings ``--tune`` chose (or ``--set`` and the defaults)."""
    from freshrec.app.replay.arms import run_arm
    from freshrec.app.replay.models import starting_models
    from freshrec.app.replay.tuning import tune_live

    run_id = hashlib.sha256(str(time.time()).encode()).hexdigest()[:6]
    tuned = tune_live(arms, inter, items, p, out, run_id, args, overrides, progress)
    models, manifest = starting_models(
        inter.take(slice(0, p.train_end)), items, out, args, progress
    )
    for arm in arms:
        result = run_arm(
            arm,
            data,
            models,
            manifest,
            out,
            run_id,
            k=args.k,
            windows=args.windows,
            timeout_s=args.timeout,
            progress=progress.update,
            overrides={**overrides, **tuned.get(arm, {}).get("settings", {})},
        )
        shares = {
            c: round(n / max(result.items_listed, 1), 3) for c, n in result.channels.most_common()
        }
        notes = (
            f"{result.timeouts} timeouts, {result.errors} errors"
            if result.timeouts or result.errors
            else ""
        )
        results.record("live", result.scores, result.wall_s, notes)
        results.live.append(result.scores)
        results.details[arm] = _live_details(result, shares, overrides, tuned.get(arm))
        bare = result.without_exclude()
        progress.done(
            f"{arm}: HR@{args.k} {results.rows[-1]['hr']}, NDCG@{args.k} {results.rows[-1]['ndcg']} "
            f"in {result.wall_s:.0f}s; items by channel {shares}; HR@{args.k} by channel "
            f"{results.details[arm]['hr_by_channel']}; a client sending no "
            f"exclusions got {bare['consumed_in_replay_share']} of its items consumed during "
            f"the replay, {bare['consumed_before_share']} before it"
        )


def _live_details(result, shares: dict, overrides: dict, tuned: dict | None) -> dict:
    """A live arm's entry in ``replay.json``'s details: its requests and replies, its events,
    and the settings it ran with and where they came from."""
    return {
        "requests": result.sent,
        "answered": result.answered,
        "timeouts": result.timeouts,
        "errors": result.errors,
        "tiers": dict(result.tiers),
        "channel_share_of_listed_items": shares,
        "hr_by_channel": {
            c: round(n / max(result.scores.total.interactions, 1), 4)
            for c, n in result.hits_by_channel.most_common()
        },
        "late_steps": result.late_steps,
        "events_read_before_the_replay": result.read_before,
        "items_listed_before_they_existed": result.unlisted,
        "events": result.events,
        "without_exclude": result.without_exclude(),
        "settings": {**overrides, **(tuned or {}).get("settings", {})},
        "settings_from": (tuned or {}).get(
            "from",
            "--set and the defaults (which were chosen on MovieLens 100K's scored part, "
            "docs/benchmarks.md)",
        ),
        **({"validation_hr": tuned["validation_hr"]} if tuned is not None else {}),
    }


def _score_baselines(baselines, data, args, results: ReplayResults, progress) -> None:
    """Each baseline in-process on the same interactions, its settings chosen on the
    training part."""
    for name in baselines:
        scores, chosen, validation, wall_s = run_baseline(
            name, data, args.k, args.windows, progress
        )
        results.baselines[name] = scores
        results.record("baseline", scores, wall_s, chosen)
        results.details[name] = {
            "chosen_on_the_training_part": chosen,
            "validation_hr": {label: round(hr, 6) for label, hr in validation.items()},
        }
        progress.done(
            f"{name} ({chosen}{choice_margin(validation, chosen, args.k)}): "
            f"HR@{args.k} {results.rows[-1]['hr']}"
        )


def _meta(args, inter, p, data, results: ReplayResults, baselines: list[str]) -> dict:
    """``replay.json`` besides the arms' rows and windows: the log, the settings, the
    details, HR by the user's and the item's history, and the paired differences."""
    import numpy as np

    from freshrec.app.replay import report

    meta = {
        "log": str(args.path),
        "interactions": len(inter),
        "train_end": p.train_end,
        "evaluated": p.evaluated,
        "repeats": p.repeats,
        "k": args.k,
        "step": args.step,
        "speed": round(data.speed, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "details": results.details,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "users": int(np.unique(inter.users).size),
    }
    meta["by_history"] = {s.name: by_history(s, p.earlier) for s in results.scored}
    meta["by_item_history"] = {s.name: by_history(s, p.item_earlier) for s in results.scored}
    scored = results.baselines
    meta["paired"] = report.paired(results.live, [scored[b] for b in baselines if b in scored])
    return meta


def _report(out: Path, results: ReplayResults, meta: dict, k: int) -> None:
    """The files in ``out``, and the tables on stdout."""
    from freshrec.app.replay import report

    files = report.write(out, results.rows, results.windows, meta, k, results.scored)
    print(report.table(results.rows, k))
    if meta["paired"]:
        print(report.paired_table(meta["paired"], k))
    print(report.history_table(meta["by_history"], k))
    print(report.history_table(meta["by_item_history"], k, "the item's earlier"))
    print("written: " + ", ".join(str(f) for f in files))
