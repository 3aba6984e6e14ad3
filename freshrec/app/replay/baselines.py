"""The in-process baselines of ``freshrec replay`` (``evaluation/baselines.py``'s registry):
each one's settings chosen on the training part, its scores on the replayed part, and how far
the chosen setting was ahead of the others."""

from __future__ import annotations

import time

from evaluation.baselines import BASELINES as SPECS
from freshrec.progress import ProgressLine

BASELINES = tuple(SPECS)
"""The baselines ``--baselines`` may name (``evaluation/baselines.py``)."""


def run_baseline(name: str, data, k: int, windows: int, progress: ProgressLine):
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
        chosen, validation = tune(factories, data.users, data.items, p.train_end, k, t_ms=data.t_ms)

    def make():
        return spec.cls(**settings[chosen])

    steps = len(p.steps)

    def on_step(index: int, scores) -> None:
        progress.update(f"{name}: step {index + 1}/{steps}")

    started = time.monotonic()
    scores = run(make(), p, data.users, data.items, data.t_ms, k, windows, name, on_step)
    return scores, chosen, validation, round(time.monotonic() - started, 1)


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
