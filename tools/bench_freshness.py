"""Benchmark of what online learning buys: the click-through rate of a closed loop's cohort
with the embeddings learning online, against the same run with them frozen, through an
interest drift.

Each arm runs on a private embedded stack with the streams app, the parameter server and one
worker as their own processes, seeded with the same trained starting embeddings and ranking
models (trained once by the benchmark, or read from ``--models``): by default trained on the
cohort's own logged impressions before the drift (``--train-on cohort``), so that the frozen
arm starts from rows that know the cohort's interests, as a production model trained
yesterday would; ``--train-on world`` trains on the world's active users instead. A cohort of active users
of the synthetic world asks for recommendations at a steady rate and clicks as the world's
ground truth says (``freshrec.sim.closedloop``); ``--before`` seconds after the first request, a
fraction of the cohort switches its main interest to another category (the world's interest
drift). Reported per ``--window`` seconds, for the users who drift and for the others: the
CTR of the replies they got; and at the start and the end of each arm, what the rows alone
know: the CTR of each cohort user's ten best items by u·v over the whole catalogue (perfect
recall, ranking by the embeddings) beside that of their truly best ten, and at the end both
among the items the loop showed anyone (the only ones with feedback). For each arm, the time
the drifted users waited after the drift until their CTR per window was back to 80% of its
level before (``evaluation.drift``), and how many times sooner than the frozen arm; a PNG of
the CTR curves (``bench_freshness_drift.png``).

Arms: ``online`` (the defaults), ``frozen`` (every learning rate 0, users' and items', local
and global: the rows keep their trained values; hot lists, item statistics and
recent clicks stay fresh, so the difference is the embeddings' online learning alone), and
learning rates: ``lr=X`` (the worker's and the parameter server's both X), ``local=X``,
``global=X``, or any setting, ``FRESHREC_NAME=VALUE``; terms join with ``+``
(``local=0.2+global=0.05``). ``FRESHREC_MODEL_DIR=DIR`` runs an arm on other models of the
same world, starting rows included (``freshrec train``'s output, say with other options).

    .venv/bin/python -m tools.bench_freshness [--cohort 200] [--rate 40] [--before 60]
                                              [--after 60] [--window 10] [--arms online,frozen]
                                              [--repeat 1] [--models DIR]
    .venv/bin/python -m tools.bench_freshness --arms frozen,lr=0.01,lr=0.05,lr=0.2

Writes artifacts/bench_freshness.json (`--out`). Needs nothing running (starts private stacks).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from freshcore import clock
from freshcore.kafka import gradients_partitions
from freshrec.app.runstatus import wait_until_assigned
from freshrec.app.stack import free_port
from freshrec.app.training import train_on_world
from freshrec.progress import ProgressLine
from freshrec.sim.closedloop import ClosedLoop, LoopStats
from freshrec.sim.world import World, WorldConfig
from inference.models.modelfile import read_manifest
from inference.training.config import TOWER_LOSSES, TrainConfig
from tools.benchlib import bench_connection, save, service_process
from tools.freshness_report import (
    arm_result,
    plot,
    recoveries,
    recovery_lines,
    summary_line,
    table,
)
from tools.rows_quality import rows_quality
from tools.seed import seed_world

DIM = 64
ARMS = {
    "online": {},
    "frozen": {
        "FRESHREC_LOCAL_LR": "0",
        "FRESHREC_LOCAL_USER_LR": "0",
        "FRESHREC_GLOBAL_LR": "0",
        "FRESHREC_GLOBAL_USER_LR": "0",
    },
}


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    arms = checked_arms(ap, args)
    progress = ProgressLine()
    world = World(WorldConfig(seed=args.seed, n_users=args.users, n_items=args.items))
    cohort = choose_cohort(world, args.cohort, args.seed)
    results: dict = {
        "world": {"seed": args.seed, "users": args.users, "items": args.items},
        "cohort": len(cohort),
        "rate_per_s": args.rate,
        "before_s": args.before,
        "after_s": args.after,
        "window_s": args.window,
        "drift_fraction": args.drift_fraction,
        "arms": {},
    }
    trained_on = cohort if args.train_on == "cohort" else None
    if args.train_impressions is None:
        args.train_impressions = 400_000 if trained_on is not None else 200_000
    results["trained_on"] = args.train_on
    # the arms rank with Wide&Deep: the other ranking models are not trained
    config = TrainConfig(impressions=args.train_impressions, dim=DIM, rankers="")
    if trained_on is not None:  # rows that know the cohort
        config = replace(config, tower_loss=args.tower_loss, tower_epochs=args.tower_epochs)
    with tempfile.TemporaryDirectory(prefix="freshrec-bench-models-") as tmp:
        models = args.models or Path(tmp)
        ensure_arm_models(ap, world, models, config, trained_on, arms, progress)
        for n in range(args.repeat):
            for arm, env in arms.items():
                name = arm if args.repeat == 1 else f"{arm} #{n + 1}"
                stats, quality = run_arm(name, env, world, models, cohort, args, progress)
                results["arms"][name] = arm_result(stats, args.before, args.before + args.after)
                results["arms"][name]["rows"] = quality
                progress.done(f"{name}: {summary_line(results['arms'][name])}")
    results["table"] = table(results["arms"], args.window)
    results["recovery"] = recoveries(results["arms"], args.before, args.window)
    print(results["table"])
    print(recovery_lines(results["recovery"]))
    save("bench_freshness", results, args.out)
    plot(args.out / "bench_freshness_drift.png", results["arms"], args.before, args.window)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohort", type=int, default=200, help="users in the cohort")
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second")
    ap.add_argument("--before", type=float, default=60.0, help="seconds before the drift")
    ap.add_argument("--after", type=float, default=60.0, help="seconds after it")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per CTR window")
    ap.add_argument(
        "--drift-fraction",
        type=float,
        default=0.5,
        help="share of the users whose main interest moves",
    )
    ap.add_argument(
        "--arms",
        default="online,frozen",
        help=f"comma-separated: {', '.join(ARMS)}, lr=X, local=X, global=X, "
        "FRESHREC_NAME=VALUE; terms of one arm joined by +",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the arms this many times, alternating (A B A B ...)",
    )
    add_world_and_model_options(ap)
    return ap


def add_world_and_model_options(ap: argparse.ArgumentParser) -> None:
    """The world, how its models are trained, where they and the results go."""
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--users", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument(
        "--train-impressions",
        type=int,
        default=None,
        help="logged impressions the models are trained on (default 400,000 for the cohort: "
        "at 200,000 the frozen arm started 12%% below the learning one; 200,000 for the world)",
    )
    ap.add_argument(
        "--train-on",
        choices=("cohort", "world"),
        default="cohort",
        help="whose impressions the models learn from: the cohort's (rows that know the "
        "cohort's interests before the drift; the default) or the world's active users",
    )
    ap.add_argument(
        "--tower-loss",
        choices=TOWER_LOSSES,
        default="softmax+logistic",
        help="the two-tower's loss when trained on the cohort: softmax over clicks (online "
        "learning then follows with softmax steps), logistic over impressions, or softmax "
        "then a logistic fine-tune on impressions (online logistic steps; the default)",
    )
    ap.add_argument("--tower-epochs", type=int, default=10, help="two-tower epochs (cohort)")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("artifacts"),
        help="directory for bench_freshness.json and the services' logs",
    )
    ap.add_argument(
        "--models",
        type=Path,
        default=None,
        help="model directory: reused when it holds this world's models, else "
        "trained into and kept (default: trained into a temporary one)",
    )


def checked_arms(ap: argparse.ArgumentParser, args) -> dict[str, dict[str, str]]:
    """Each arm's environment, by name; the parser's error for an arm or a figure it cannot
    run."""
    try:
        arms = {a.strip(): arm_env(a.strip()) for a in args.arms.split(",") if a.strip()}
    except ValueError as exc:
        ap.error(f"--arms: {exc}")
    if not arms:
        ap.error("--arms: name at least one arm")
    if (
        min(args.cohort, args.repeat, args.train_impressions or 1) < 1
        or min(args.rate, args.window) <= 0
    ):
        ap.error("--cohort, --rate, --window, --repeat and --train-impressions must be positive")
    if args.before < 0 or args.after < 0 or not 0 <= args.drift_fraction <= 1:
        ap.error("--before and --after must be >= 0, --drift-fraction in [0, 1]")
    return arms


def ensure_arm_models(ap, world, models: Path, config, trained_on, arms, progress) -> None:
    """Models of this world (and cohort) in ``models``, trained there with ``config`` when
    it holds none; the parser's error when it, or an arm's own directory, holds others."""
    source = world.source(trained_on)
    if not (models / "manifest.json").exists():
        progress.done(f"training models for the benchmark world into {models}")
        models.mkdir(parents=True, exist_ok=True)
        train_on_world(world, config, models, progress.update, users=trained_on)
    elif not holds_models_of(models, source):
        ap.error(f"--models {models} holds models of another world or cohort")
    elif (held := trained_with(models, config)) is not None:
        ap.error(f"--models {models} was trained with {held}: train into another directory")
    for arm, env in arms.items():
        own = env.get("FRESHREC_MODEL_DIR")
        if own and not holds_models_of(Path(own), source):
            ap.error(f"--arms {arm}: {own} holds no models of this world and cohort")


RATES = {
    "lr": ("FRESHREC_LOCAL_LR", "FRESHREC_GLOBAL_LR"),
    "local": ("FRESHREC_LOCAL_LR",),
    "global": ("FRESHREC_GLOBAL_LR",),
}


def arm_env(arm: str) -> dict[str, str]:
    """The environment of an arm: one of ``ARMS``, or learning rates joined by ``+``:
    ``lr=X`` (the worker's local step and the parameter server's Adagrad both X),
    ``local=X``, ``global=X``; or any ``FRESHREC_NAME=VALUE`` setting of the services.

    >>> arm_env("lr=0.2")
    {'FRESHREC_LOCAL_LR': '0.2', 'FRESHREC_GLOBAL_LR': '0.2'}
    >>> arm_env("local=0.2+global=0.05")
    {'FRESHREC_LOCAL_LR': '0.2', 'FRESHREC_GLOBAL_LR': '0.05'}
    >>> arm_env("FRESHREC_FLUSH_INTERVAL_MS=20")
    {'FRESHREC_FLUSH_INTERVAL_MS': '20'}
    """
    if arm in ARMS:
        return ARMS[arm]
    env: dict[str, str] = {}
    for term in arm.split("+"):
        name, _, value = term.partition("=")
        if name.startswith("FRESHREC_") and value:
            env[name] = value  # any setting; the service checks its value
            continue
        if name not in RATES or not value:
            raise ValueError(
                f"unknown arm {arm!r}; expected {', '.join(ARMS)}, lr=X, local=X, global=X"
                " or FRESHREC_NAME=VALUE terms joined by +"
            )
        lr = float(value)
        if not lr >= 0:
            raise ValueError(f"a learning rate must be >= 0, got {term}")
        env.update(dict.fromkeys(RATES[name], repr(lr)))
    return env


def choose_cohort(world: World, size: int, seed: int) -> np.ndarray:
    """``size`` distinct active users (drawn like the world's traffic, Zipf by activity)."""
    rng = np.random.default_rng(seed)
    picked: dict[int, None] = {}
    while len(picked) < min(size, world.config.n_users):
        for u in world.sample_users(rng, size).tolist():
            picked.setdefault(int(u), None)
            if len(picked) == size:
                break
    return np.fromiter(picked, np.int64)


def run_arm(arm, arm_env, world, models, cohort, args, progress) -> tuple[LoopStats, dict]:
    env = {"FRESHREC_MODEL_DIR": str(models), "FRESHREC_EMBEDDING_DIM": str(DIM), **arm_env}
    models = Path(env["FRESHREC_MODEL_DIR"])  # an arm may bring its own (starting rows too)
    logs = args.out / "bench_freshness-logs" / re.sub(r"[^\w.=+-]+", "_", arm)
    # a prefix of its own: on shared services (KAFKA_BOOTSTRAP_SERVERS set) no arm reads
    # another's topics or rows
    prefix = f"fresh{time.time_ns() % 10**12}."
    with bench_connection(prefix) as conn, contextlib.ExitStack() as services:
        seed_world(conn.redis_url, conn.topic_prefix, world, models, gradients_partitions(conn))
        quality = {"start": rows_quality(conn, world, cohort, clock.now_ms(), dim=DIM)}
        check = start_services(conn, services, env, logs, arm, progress)
        loop = ClosedLoop(
            conn,
            world,
            args.rate,
            seed=args.seed,
            users=cohort,
            drift_after_s=args.before,
            drift_fraction=args.drift_fraction,
            window_s=args.window,
        )
        drive(loop, arm, args, check, progress)
        if loop.stats.replied == 0:
            raise RuntimeError(f"{arm}: no request was answered (logs in {logs})")
        quality["end"] = rows_quality(
            conn, loop.world, cohort, clock.now_ms(), loop.stats.shown, dim=DIM
        )
        return loop.stats, quality


def start_services(conn, services, env: dict, logs: Path, arm: str, progress):
    """The streams app, the parameter server and a worker (on the exit stack ``services``),
    once each owns partitions; a check that raises if any of them has stopped."""
    ports = {name: free_port() for name in ("streams", "param-server", "worker")}
    procs = {
        name: services.enter_context(
            service_process(conn, name, port, env, log=logs / f"{name}.log")
        )
        for name, port in ports.items()
    }

    def check() -> None:
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{arm}: {', '.join(dead)} stopped during the run (logs in {logs})")

    def waiting(names) -> None:
        check()
        progress.update(f"{arm}: waiting for {names}")

    wait_until_assigned(ports, 120, waiting)
    return check


def drive(loop: ClosedLoop, arm: str, args, check, progress) -> None:
    """The closed loop through ``--before`` and ``--after`` seconds from its first request,
    the services checked every second."""
    stop = threading.Event()
    thread = loop.run_in_thread(stop)
    try:
        give_up = time.monotonic() + 60
        while loop.stats.sent == 0:  # its client connects first
            if not thread.is_alive() or time.monotonic() > give_up:
                raise RuntimeError(f"{arm}: the closed loop sent no request")
            time.sleep(0.1)
        end = loop.stats.started + args.before + args.after
        while time.monotonic() < end:
            time.sleep(min(1.0, max(end - time.monotonic(), 0.0)))
            check()
            if not thread.is_alive():
                raise RuntimeError(f"{arm}: the closed loop stopped early")
            s = loop.stats
            phase = "before" if time.monotonic() - s.started < args.before else "after"
            progress.update(f"{arm}: {phase} the drift | {s.line()}")
    finally:
        stop.set()
        thread.join(args.window + 15)


def trained_with(directory: Path, config: TrainConfig) -> str | None:
    """How the models in ``directory`` were trained where that differs from ``config`` in what
    the benchmark sets (impressions, the two-tower's loss and epochs); None if it does not."""
    held = read_manifest(directory).get("training", {}).get("config", {})
    wanted = {k: getattr(config, k) for k in ("impressions", "tower_loss", "tower_epochs")}
    differ = {k: held.get(k) for k, v in wanted.items() if held.get(k) != v}
    return ", ".join(f"{k} {v}" for k, v in differ.items()) or None


def holds_models_of(directory: Path, source: str) -> bool:
    if not (directory / "manifest.json").exists():
        return False
    return read_manifest(directory).get("source") == source


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as exc:  # a service or the loop failed: say which, without a trace
        raise SystemExit(f"bench_freshness: {exc}") from None
