"""``freshrec replay --tune``: the live arms' settings searched on a validation replay, the
training part's last tenth replayed through the live pipeline with models trained on its first
90%; the scored part is then replayed once, with each arm's best."""

from __future__ import annotations

import itertools
from pathlib import Path

from freshrec.app.replay.models import starting_models


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


def tune_live(arms, inter, items, p, out: Path, run_id, args, overrides, progress) -> dict:
    """Per live arm, the ``--tune`` setting that did best (HR@k) on the validation replay:
    the training part's last tenth replayed through the live pipeline, with models trained on
    its first 90%. Only the training part is read (``validation_cut``)."""
    from evaluation.protocol import validation_cut
    from freshrec.app.replay.arms import run_arm
    from freshrec.app.replay.data import prepare

    grid = tuning_grid(args.tuning)
    if not grid:
        return {}
    cut, inner = validation_cut(inter.users, inter.items, p.train_end, args.step)
    train = inter.take(slice(0, cut))
    progress.done(
        f"tuning {len(grid)} setting(s) per live arm on a validation replay of the training "
        f"part's last {inner.evaluated:,} interactions ({len(inner.steps)} steps)"
    )
    data = prepare(train, items, inner, args.windows, args.duration, args.speed)
    validation = out / "validation"
    models, manifest = starting_models(
        train.take(slice(0, inner.train_end)), items, validation, args, progress
    )
    chosen = {}
    for arm in arms:
        hr = {}
        for settings in grid:
            label = ",".join(f"{k}={v}" for k, v in settings.items())
            result = run_arm(
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
