"""One live arm of ``freshrec replay``: a log's replayed part through a whole FreshRec
pipeline (streams app, parameter server, worker, each its own process), asked about over the
public request/reply protocol.

Per arm, on a stack of its own (the embedded broker and Redis; or, with
``KAFKA_BOOTSTRAP_SERVERS``/``REDIS_URL``, topics and keys under a prefix of its own):
the topics are created, the starting rows trained on the log's training part are written to
Redis, the streams app (and the parameter server) start, the catalogue goes to ``items``,
and the training part's interactions to ``events`` (``history.py``: the streams app counts
them, as it would have had it run through that part; the workers' group is committed past
them, so the worker does not learn again what its starting rows were trained on). Then the
worker starts, and once it lists the catalogue the steps run (``steps.py``,
``evaluation/protocol.py``): the step's users ask for k items (their training-part items, the
newest 1,000, in ``exclude``; ``exclude_seen`` for the rest), the lists are scored, the step's
interactions go to ``events`` as clicks (conversions stay conversions) stamped with their
re-timed event time, and the next step waits until the worker has read them.

Event times are the log's, moved onto the present (``data.stamp``): the replayed part starts
now and runs ``speed`` times faster than it happened; a step never sends an event stamped in
the future (it waits), and a replay slower than its speed stamps events in the past.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from freshcore import clock
from freshcore.settings import ConnectionSettings, load_environment
from freshrec.app.replay.data import EXCLUDE_MAX, ReplayData
from freshrec.app.replay.steps import ArmResult
from freshrec.app.stack import EmbeddedStack, external_services, free_port

ARMS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # the services an arm runs, and its settings
    "frozen": (
        ("streams", "param-server", "worker"),
        {"FRESHREC_LOCAL_LR": "0", "FRESHREC_LOCAL_USER_LR": "0", "FRESHREC_GLOBAL_LR": "0"},
    ),
    "local": (("streams", "worker"), {}),
    "full": (("streams", "param-server", "worker"), {}),
}
WITHOUT = "full-without-"
"""An ablation arm: ``full`` with one recall channel off, e.g. ``full-without-covisit``."""


def arm_spec(name: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The services an arm runs and its settings: one of ``ARMS``, or an ablation of
    ``full`` (``WITHOUT`` + a recall channel: every other channel runs).

    >>> arm_spec("full-without-hot")[1]["FRESHREC_RECALL_CHANNELS"].split(",")[:3]
    ['vector', 'i2i', 'covisit']
    """
    if name in ARMS:
        return ARMS[name]
    from inference.serving.channels import CHANNELS

    channel = name.removeprefix(WITHOUT)
    if not name.startswith(WITHOUT) or channel not in CHANNELS:
        known = [*ARMS, *(WITHOUT + c for c in CHANNELS)]
        raise KeyError(f"unknown arm {name!r} (known: {', '.join(known)})")
    others = ",".join(c for c in CHANNELS if c != channel)
    services, settings = ARMS["full"]
    return services, {**settings, "FRESHREC_RECALL_CHANNELS": others}


def ablations() -> list[str]:
    """Every ablation arm: ``full`` without each recall channel in turn."""
    from inference.serving.channels import CHANNELS

    return [WITHOUT + c for c in CHANNELS]


SERVING = {"FRESHREC_MMR_LAMBDA": "1.0"}
"""Every live arm serves by relevance alone, as the baselines do: the arms compare learners,
not diversity policies (``--set FRESHREC_MMR_LAMBDA=0.7`` measures what diversity costs)."""


@contextlib.contextmanager
def arm_stack(name: str, workdir: Path, run_id: str) -> Iterator[ConnectionSettings]:
    """A broker and Redis for the arm: its own embedded ones, or the configured services
    under a topic prefix of its own."""
    if external_services():
        base = ConnectionSettings.from_env(load_environment())
        yield base.with_prefix(f"{base.topic_prefix}replay-{run_id}-{name}.")
        return
    stack = EmbeddedStack(workdir / f"stack-{name}")
    stack.down()  # a previous replay killed half-way
    state = stack.up(detach=False)
    try:
        env = dict(os.environ)
        env.update(state.env)
        yield ConnectionSettings.from_env(env)
    finally:
        stack.down()


def arm_env(
    conn: ConnectionSettings,
    models: Path,
    manifest: dict,
    timeout_s: float,
    overrides: dict[str, str] | None,
    settings: dict[str, str],
    speed: float = 1.0,
) -> dict[str, str]:
    """The environment of an arm's services: its stack, the starting models, the serving
    settings every arm shares, then ``overrides``, then the arm's own ``settings``. The
    replay's events run ``speed`` times faster than they happened: the event time scale says
    so, and the decays keep their meaning in the log's own time (an hour of the log, not
    of the replay)."""
    return {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": conn.kafka_bootstrap_servers,
        "REDIS_URL": conn.redis_url,
        "FRESHREC_TOPIC_PREFIX": conn.topic_prefix,
        "FRESHREC_KAFKA_PROFILE": conn.kafka_profile,
        "FRESHREC_MODEL_DIR": str(models),
        "FRESHREC_EMBEDDING_DIM": str(manifest["dim"]),
        "FRESHREC_SEEN_PER_USER": str(EXCLUDE_MAX),
        # a step's requests arrive at once: the tiers plan to the request's timeout, not to
        # a latency objective, so a list's quality does not depend on the machine's speed
        "FRESHREC_REQUEST_BUDGET_MS": str(int(timeout_s * 1000)),
        "FRESHREC_EVENT_TIME_SCALE": repr(float(speed)),
        **SERVING,
        **(overrides or {}),
        **settings,  # the arm's own (frozen's learning rates of 0) win
    }


def run_arm(
    name: str,
    data: ReplayData,
    models: Path,
    manifest: dict,
    workdir: Path,
    run_id: str,
    *,
    k: int = 10,
    windows: int = 10,
    timeout_s: float = 10.0,
    progress: Callable[[str], None] = lambda line: None,
    overrides: dict[str, str] | None = None,
) -> ArmResult:
    """Replay ``data`` through a pipeline set up as arm ``name`` says (``ARMS``)."""
    from evaluation.metrics import ArmScores
    from freshrec.app.commands import provision_topics
    from freshrec.app.replay.history import send_history
    from freshrec.app.replay.steps import replay_steps
    from freshrec.app.runstatus import wait_until_assigned
    from freshrec.app.supervisor import ServiceGroup
    from freshrec.app.training import load_starting_embeddings

    services_of, settings = arm_spec(name)
    result = ArmResult(name, ArmScores(name, k, windows))
    with arm_stack(name, workdir, run_id) as conn:
        provision_topics(conn)
        load_starting_embeddings(conn, models, manifest)
        env = arm_env(conn, models, manifest, timeout_s, overrides, settings, data.speed)
        group = ServiceGroup(env, workdir / f"logs-{name}")
        ports = {s: free_port() for s in services_of}
        try:
            for service in services_of:
                if service != "worker":
                    group.start(service, service, FRESHREC_METRICS_PORT=str(ports[service]))
            others = {s: p for s, p in ports.items() if s != "worker"}
            progress(f"{name}: waiting for {', '.join(others)} to join")
            wait_until_assigned(others, 120, lambda waiting: group.check())
            wall0 = clock.now_ms()
            send_history(conn, data, wall0, ports["streams"], group, progress, name)
            group.start("worker", "worker", FRESHREC_METRICS_PORT=str(ports["worker"]))
            wait_until_assigned({"worker": ports["worker"]}, 120, lambda waiting: group.check())
            started = time.monotonic()
            asyncio.run(
                replay_steps(
                    name, data, conn, ports["worker"], result, k, timeout_s, progress, group, wall0
                )
            )
            result.wall_s = round(time.monotonic() - started, 1)
            group.check()
        finally:
            group.stop_all()
    return result
