"""``freshrec replay PATH``: prequential evaluation of FreshRec on an interaction log, arm by
arm through the live pipeline, beside reference baselines computed in-process on exactly the
same interactions (``docs/replay.md``).

1. Read the log (``inference/training/interactions.py``) and cut it at ``--train-share`` by time.
2. Train the starting models on the part before the cut (``freshrec train --log``; cached in
   ``OUT/models`` for the same log part and settings).
3. For each live arm (``replayarm.py``): ``frozen`` (the whole pipeline, learning rates 0),
   ``local`` (no parameter server), ``full``; each on a fresh stack.
4. The baselines (``evaluation/baselines.py``), their settings chosen on the training part
   (``evaluation/prequential.tune``).
5. The table, CSV files, a JSON report and the HR@k plot (``replayreport.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

from evaluation.baselines import BASELINES as SPECS
from evaluation.metrics import by_history
from freshcore.settings import state_dir
from freshrec.progress import ProgressLine

log = logging.getLogger("freshrec.replay")
BASELINES = tuple(SPECS)
"""The baselines ``--baselines`` may name (``evaluation/baselines.py``)."""


def add_parser(sub) -> None:
    from freshrec.app.options import add_log_options

    p = sub.add_parser(
        "replay",
        help="prequential evaluation on an interaction log: live arms and baselines",
    )
    p.add_argument("path", help="the interaction log (CSV, TSV, JSON Lines; gzipped or not)")
    add_log_options(p)
    p.add_argument(
        "--train-share",
        type=float,
        default=0.8,
        help="the first share of the log, by time, that trains the starting models (0.8)",
    )
    p.add_argument(
        "--sample", type=float, default=1.0, help="share of the replayed interactions scored"
    )
    p.add_argument("-k", type=int, default=10, help="list length (10)")
    p.add_argument(
        "--step",
        type=int,
        default=100,
        help="interactions per step: lists are asked for before a step's interactions are "
        "produced (100)",
    )
    p.add_argument("--arms", default="frozen,local,full", help="live arms (frozen,local,full)")
    p.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help=f"in-process baselines ({','.join(BASELINES)}; empty for none)",
    )
    p.add_argument("--windows", type=int, default=10, help="time windows of the report (10)")
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help="how many times faster than it happened the replayed part runs (default: "
        "its span over --duration)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="with no --speed: the replayed part's span is mapped onto this many seconds",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a request may wait")
    p.add_argument("--negatives", type=int, default=4, help="as `freshrec train --negatives`")
    p.add_argument("--tower-epochs", type=int, default=None, help="two-tower epochs (10)")
    p.add_argument(
        "--tower-share",
        type=float,
        default=None,
        help="as `freshrec train --tower-share` (default: LOG_CONFIG's)",
    )
    p.add_argument("--out", default=None, help="output folder (default .freshrec/replay/NAME)")
    p.add_argument("--seed", type=int, default=1, help="seed of the sample")
    p.add_argument(
        "--train-seed",
        type=int,
        default=None,
        help="seed of the starting models' training (default: LOG_CONFIG's, 11): runs with "
        "different seeds give the live arms' spread over training",
    )
    p.add_argument(
        "--tune",
        dest="tuning",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="search a setting of the live arms (repeatable: every combination) on a "
        "validation replay, the training part's last tenth with models trained on the rest; "
        "the scored part is then replayed once, with the best. E.g. --tune "
        "FRESHREC_MMR_LAMBDA=0.7,1.0",
    )
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for every live arm's services (repeatable), e.g. "
        "--set FRESHREC_MMR_LAMBDA=1.0",
    )
    p.set_defaults(func=cmd_replay)


def _models(prefix, items, out: Path, args, progress: ProgressLine) -> tuple[Path, dict]:
    """Models trained on the log's training part: reused when ``out/models`` holds the ones
    for this part and these settings, else trained."""
    from freshrec.app.training import served_rankers
    from inference.models.modelfile import ModelFileError, read_manifest
    from inference.training.logtrain import LOG_CONFIG, fingerprint, train_from_log

    cfg = replace(
        LOG_CONFIG,
        tower_epochs=args.tower_epochs or LOG_CONFIG.tower_epochs,
        tower_share=args.tower_share or LOG_CONFIG.tower_share,
        rankers=served_rankers(),
        seed=LOG_CONFIG.seed if args.train_seed is None else args.train_seed,
    )
    key = {
        "log": fingerprint(prefix),
        "items": hashlib.sha256("\0".join(items.ids).encode()).hexdigest()[:16],
        "negatives": args.negatives,
        "config": asdict(cfg),
    }
    directory = out / "models"
    key_file = directory / "replay-key.json"
    try:
        manifest = read_manifest(directory)
        if key_file.exists() and json.loads(key_file.read_text()) == key:
            progress.done(
                f"models {manifest['version']} of this training part found in {directory}"
            )
            return directory, manifest
    except (ModelFileError, ValueError):
        pass
    started = time.monotonic()
    manifest = train_from_log(prefix, items, directory, progress.update, cfg, args.negatives)
    key_file.write_text(json.dumps(key) + "\n")
    from freshrec.app.training import held_out_line

    progress.done(
        f"trained {manifest['version']} on the training part in "
        f"{time.monotonic() - started:.0f}s; held out: " + held_out_line(manifest["training"])
    )
    return directory, manifest


def tuning_grid(specs: list[str]) -> list[dict[str, str]]:
    """Every combination of ``--tune NAME=V1,V2`` values.

    >>> tuning_grid(["A=1,2", "B=x"])
    [{'A': '1', 'B': 'x'}, {'A': '2', 'B': 'x'}]
    >>> tuning_grid([])
    []
    """
    axes: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        options = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name or not options:
            raise SystemExit(f"freshrec replay: --tune {spec!r}: expected NAME=V1,V2,...")
        axes[name] = options
    if not axes:
        return []
    names = list(axes)
    return [dict(zip(names, vs, strict=True)) for vs in itertools.product(*axes.values())]


def choice_margin(validation: dict[str, float], chosen: str, k: int) -> str:
    """How far the chosen setting was ahead of the best of the others on the training part's
    last tenth, for the line that reports a baseline: a margin inside that tenth's noise
    means another setting could as well have been chosen (an equal HR: the choice fell to
    NDCG).

    >>> choice_margin({"window=10": 0.0123, "window=50": 0.0121, "window=90": 0.01}, "window=10", 10)
    '; validation HR@10 0.0123, next window=50 0.0121'
    >>> choice_margin({"window=10": 0.0123, "window=50": 0.0123}, "window=50", 10)
    '; validation HR@10 0.0123, next window=10 0.0123'
    >>> choice_margin({"-": 0.02}, "-", 10)
    ''
    """
    others = {label: hr for label, hr in validation.items() if label != chosen}
    if chosen not in validation or not others:
        return ""
    second = max(others, key=lambda label: others[label])
    return f"; validation HR@{k} {validation[chosen]:.4f}, next {second} {others[second]:.4f}"


def _tune_live(arms, inter, items, p, out: Path, run_id, args, overrides, progress) -> dict:
    """Per live arm, the ``--tune`` setting that did best (HR@k) on the validation replay:
    the training part's last tenth replayed through the live pipeline, with models trained on
    its first 90%. Only the training part is read (``validation_cut``)."""
    from evaluation.protocol import validation_cut
    from freshrec.app import replayarm

    grid = tuning_grid(args.tuning)
    if not grid:
        return {}
    cut, inner = validation_cut(inter.users, inter.items, p.train_end, args.step)
    train = inter.take(slice(0, cut))
    progress.done(
        f"tuning {len(grid)} setting(s) per live arm on a validation replay of the training "
        f"part's last {inner.evaluated:,} interactions ({len(inner.steps)} steps)"
    )
    data = replayarm.prepare(train, items, inner, args.windows, args.duration, args.speed)
    validation = out / "validation"
    models, manifest = _models(
        train.take(slice(0, inner.train_end)), items, validation, args, progress
    )
    chosen = {}
    for arm in arms:
        hr = {}
        for settings in grid:
            label = ",".join(f"{k}={v}" for k, v in settings.items())
            result = replayarm.run_arm(
                arm,
                data,
                models,
                manifest,
                validation,
                f"{run_id}v",
                k=args.k,
                windows=args.windows,
                timeout_s=args.timeout,
                progress=progress.update,
                overrides={**overrides, **settings},
            )
            hr[label] = round(result.scores.total.hit_rate, 6)  # 4 decimals tie: sparse logs
            progress.done(f"{arm} on the validation replay, {label}: HR@{args.k} {hr[label]:.4f}")
        best = max(grid, key=lambda s: hr[",".join(f"{k}={v}" for k, v in s.items())])
        chosen[arm] = {
            "settings": best,
            "from": "--tune: the best HR@k on a validation replay of the training part's last "
            "tenth (models trained on its first 90%)",
            "validation_hr": hr,
        }
    return chosen


def _baseline(name: str, data, k: int, windows: int, progress: ProgressLine):
    """The baseline's scores on the replay, its settings tuned on the training part, and each
    setting's HR@k on the training part's last tenth (empty when there was nothing to choose)."""
    from evaluation.prequential import run, tune

    spec = SPECS.get(name)
    if spec is None:
        raise SystemExit(f"freshrec replay: unknown baseline {name!r} (known: {BASELINES})")
    p = data.plan
    settings = dict(spec.candidates(p.train_end))
    chosen, validation = next(iter(settings)), {}
    if len(settings) > 1:
        factories = [(label, lambda s=s: spec.cls(**s)) for label, s in settings.items()]
        chosen, validation = tune(factories, data.users, data.items, p.train_end, k)

    def make():
        return spec.cls(**settings[chosen])

    steps = len(p.steps)

    def on_step(index: int, scores) -> None:
        progress.update(f"{name}: step {index + 1}/{steps}")

    started = time.monotonic()
    scores = run(make(), p, data.users, data.items, data.t_ms, k, windows, name, on_step)
    return scores, chosen, validation, round(time.monotonic() - started, 1)


def cmd_replay(args: argparse.Namespace) -> int:
    import numpy as np

    from evaluation.protocol import plan as make_plan
    from freshrec.app import replayarm, replayreport
    from freshrec.app.options import read_log_from_args

    arms = [a for a in args.arms.split(",") if a]
    baselines = [b for b in args.baselines.split(",") if b]
    unknown = [a for a in arms if a not in replayarm.ARMS]
    if unknown:
        raise SystemExit(
            f"freshrec replay: unknown arm(s) {unknown} (known: {list(replayarm.ARMS)})"
        )
    overrides = {}
    for pair in args.settings:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"freshrec replay: --set {pair!r}: expected NAME=VALUE")
        overrides[name] = value
    progress = ProgressLine()
    inter, items = read_log_from_args(args, args.path, progress)
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
    out = Path(args.out or state_dir() / "replay" / Path(args.path).name.split(".")[0])
    out.mkdir(parents=True, exist_ok=True)
    progress.done(
        f"replaying {len(inter) - p.train_end:,} interactions after the first {p.train_end:,} "
        f"in {len(p.steps):,} steps: {p.evaluated:,} evaluated, {p.repeats:,} repeats "
        f"(the user had the item already), {p.unsampled:,} outside the sample"
    )
    data = replayarm.prepare(inter, items, p, args.windows, args.duration, args.speed)
    rows: list[dict] = []
    windows: list[dict] = []
    live_scores: list = []
    extra: dict[str, dict] = {}
    catalogue = len(set(inter.items.tolist()) | set(items.ids))

    def record(name, kind, scores, wall_s, notes="") -> None:
        rows.append({**scores.summary(catalogue), "kind": kind, "wall_s": wall_s, "notes": notes})
        t0 = int(inter.t_ms[p.train_end])
        span = max(int(inter.t_ms[-1]) - t0, 1)
        for w in scores.window_rows():
            windows.append({**w, "from_ms": t0 + span * w["window"] // args.windows})

    if arms:
        run_id = hashlib.sha256(str(time.time()).encode()).hexdigest()[:6]
        tuned = _tune_live(arms, inter, items, p, out, run_id, args, overrides, progress)
        models, manifest = _models(inter.take(slice(0, p.train_end)), items, out, args, progress)
        for arm in arms:
            result = replayarm.run_arm(
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
                c: round(n / max(result.items_listed, 1), 3)
                for c, n in result.channels.most_common()
            }
            notes = (
                f"{result.timeouts} timeouts, {result.errors} errors"
                if result.timeouts or result.errors
                else ""
            )
            record(arm, "live", result.scores, result.wall_s, notes)
            live_scores.append(result.scores)
            extra[arm] = {
                "requests": result.sent,
                "answered": result.answered,
                "timeouts": result.timeouts,
                "errors": result.errors,
                "tiers": dict(result.tiers),
                "channel_share_of_listed_items": shares,
                "late_steps": result.late_steps,
                "events_read_before_the_replay": result.read_before,
                "events": result.events,
                "without_exclude": result.without_exclude(),
                "settings": {
                    **overrides,
                    **tuned.get(arm, {}).get("settings", {}),
                },
                "settings_from": tuned.get(arm, {}).get(
                    "from",
                    "--set and the defaults (which were chosen on MovieLens 100K's scored part, "
                    "docs/benchmarks.md)",
                ),
                **({"validation_hr": tuned[arm]["validation_hr"]} if arm in tuned else {}),
            }
            bare = result.without_exclude()
            progress.done(
                f"{arm}: HR@{args.k} {rows[-1]['hr']}, NDCG@{args.k} {rows[-1]['ndcg']} in "
                f"{result.wall_s:.0f}s; items by channel {shares}; a client sending no "
                f"exclusions got {bare['consumed_in_replay_share']} of its items consumed during "
                f"the replay, {bare['consumed_before_share']} before it"
            )
    scored: dict[str, object] = {}  # baseline -> its ArmScores, for the paired differences
    for name in baselines:
        scores, chosen, validation, wall_s = _baseline(name, data, args.k, args.windows, progress)
        scored[name] = scores
        record(name, "baseline", scores, wall_s, chosen)
        extra[name] = {
            "chosen_on_the_training_part": chosen,
            "validation_hr": {label: round(hr, 6) for label, hr in validation.items()},
        }
        progress.done(
            f"{name} ({chosen}{choice_margin(validation, chosen, args.k)}): HR@{args.k} {rows[-1]['hr']}"
        )
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
        "details": extra,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "users": int(np.unique(inter.users).size),
    }
    meta["by_history"] = {
        s.name: by_history(s, p.earlier) for s in [*live_scores, *scored.values()]
    }
    meta["by_item_history"] = {
        s.name: by_history(s, p.item_earlier) for s in [*live_scores, *scored.values()]
    }
    meta["paired"] = replayreport.paired(live_scores, [scored[b] for b in baselines if b in scored])
    arms = [*live_scores, *scored.values()]
    files = replayreport.write(out, rows, windows, meta, args.k, arms)
    print(replayreport.table(rows, args.k))
    if meta["paired"]:
        print(replayreport.paired_table(meta["paired"], args.k))
    print(replayreport.history_table(meta["by_history"], args.k))
    print(replayreport.history_table(meta["by_item_history"], args.k, "the item's earlier"))
    print("written: " + ", ".join(str(f) for f in files))
    return 0
