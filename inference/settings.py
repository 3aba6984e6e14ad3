"""Settings of ``freshrec worker``, read from the environment at the edge.

Each is declared once (``freshcore/declare.py``): the worker's own fields below, the serving
settings in ``serving/settings.py``, and here the online learning's, whose defaults are
``LearningSettings``' and ``LabelConfig``'s own unless the models' manifest recommends others.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from freshcore.declare import Setting, SettingsError, declared, declared_as, read_settings
from freshcore.hotscore import HotWeights
from freshcore.settings import (
    DEDUPE_WINDOW,
    HOT_K,
    LEARNING_RATE,
    METRICS_PORT,
    ROW_TTL_S,
    ConnectionSettings,
    HotScoreSettings,
    RowSettings,
    dead_letter_limits,
    model_dir,
    online_defaults,
)
from inference.device import STORAGE_DTYPES
from inference.learning.learner import LearningSettings
from inference.learning.steps import LOSSES, LabelConfig
from inference.serving.breaker import BreakerConfig
from inference.serving.modes import DAILY, MODE, ModeError, declared_modes, mode_env
from inference.serving.settings import (
    MAX_BATCH,
    MAX_WAIT_MS,
    RECALL_INJECT_DELAY_MS,
    SERVED_RANKERS,
    ServingSettings,
    breaker,
    heat_split,
)
from schemas.codec import DeadLetterLimits

__all__ = ["SERVED_RANKERS", "ModeSettings", "WorkerSettings", "heat_split", "served_ranker"]

LEARNING = "learning"

LOCAL_LR = Setting(
    "FRESHREC_LOCAL_LR",
    LEARNING_RATE,
    "The worker's local step size of item rows, v ← v − lr·g.",
    kind=float,
    minimum=0,
    group=LEARNING,
    shown="the models' manifest (`online.item_lr`), else 0.05",
)
LOCAL_USER_LR = Setting(
    "FRESHREC_LOCAL_USER_LR",
    LEARNING_RATE,
    "The worker's local step size of user rows (a user's row is touched by that user's "
    "events alone).",
    kind=float,
    minimum=0,
    group=LEARNING,
    shown="the models' manifest (`online.user_lr`), else `FRESHREC_LOCAL_LR`",
)
LEARNING_LOSS = Setting(
    "FRESHREC_LEARNING_LOSS",
    "auto",
    "The local step's loss: `logistic`, `softmax`, or `auto` (what the models' manifest "
    "says, else `logistic`).",
    choices=("auto", *LOSSES),
    group=LEARNING,
)
SAMPLED_NEGATIVES = Setting(
    "FRESHREC_SAMPLED_NEGATIVES",
    LabelConfig.sampled_negatives,
    "Negatives per positive: the logistic loss's when a batch has none, the softmax's always.",
    kind=int,
    minimum=0,
    group=LEARNING,
    shown="the models' manifest, else 2",
)
ADMISSION_TOUCHES = Setting(
    "FRESHREC_ADMISSION_TOUCHES",
    LearningSettings.admission_touches,
    "Touches before a row's gradients go to the parameter server (Monolith's occurrence filter).",
    kind=int,
    minimum=1,
    group=LEARNING,
)
ADMISSION_WINDOW_S = Setting(
    "FRESHREC_ADMISSION_WINDOW_S",
    LearningSettings.admission_window_s,
    "Touch counts of rows unseen this long are forgotten.",
    kind=int,
    minimum=1,
    group=LEARNING,
)
GRADIENT_LINGER_MS = Setting(
    "FRESHREC_GRADIENT_LINGER_MS",
    LearningSettings.gradient_linger_ms,
    "How long admitted gradients wait to leave summed per row (0: one set of messages per "
    "learnt slice).",
    kind=int,
    minimum=0,
    group=LEARNING,
)
MAX_PENDING_STEPS = Setting(
    "FRESHREC_MAX_PENDING_STEPS",
    LearningSettings.max_pending_steps,
    "Bound of the read-your-writes pool: past it the oldest sent steps are let go.",
    kind=int,
    minimum=1_000,
    group=LEARNING,
)
EXPERIMENTS_FILE = Setting(
    "FRESHREC_EXPERIMENTS_FILE",
    None,
    "An A/B experiment's TOML file: each user's requests get their variant "
    "([experiments](experiments.md)).",
    kind=Path,
)


def _pattern(raw: str) -> str:
    try:
        re.compile(raw)
    except re.error as exc:
        raise ValueError(str(exc)) from None
    return raw


@dataclass(frozen=True)
class WorkerSettings:
    conn: ConnectionSettings = field(default_factory=ConnectionSettings)
    learning: LearningSettings = field(default_factory=LearningSettings)
    user_capacity_rows: int = declared(
        "FRESHREC_USER_CACHE_ROWS", 200_000, "The device's user slab (LRU), rows.", minimum=1
    )
    host_user_rows: int = declared(
        "FRESHREC_HOST_USER_ROWS",
        500_000,
        "User rows host RAM holds after the device slab lets them go (0: none).",
        minimum=0,
        group=LEARNING,
    )
    """The cache's second level, ``inference/tables/host.py``."""
    host_item_rows: int = declared(
        "FRESHREC_HOST_ITEM_ROWS",
        200_000,
        "Item rows host RAM holds after the size bound lets them go.",
        minimum=0,
        group=LEARNING,
    )
    row_ttl_s: int = declared_as(ROW_TTL_S)
    """Item rows that no event and no broadcast update has touched this long leave the item
    table, unless the catalogue lists them (0: never). The parameter server's setting of the
    same name lets such rows expire in Redis and leave its memory."""
    max_item_rows: int = declared(
        "FRESHREC_MAX_ITEM_ROWS",
        2_000_000,
        "Item rows the table holds beyond the catalogue's; past it the least recently "
        "touched leave for host RAM.",
        minimum=1,
        group=LEARNING,
    )
    """``EmbeddingCache.evict_items``: a flood of unknown item ids in events cannot grow the
    worker without bound."""
    batch_max: int = declared(
        "FRESHREC_WORKER_BATCH_MAX",
        2000,
        "Messages per consume call, at least.",
        minimum=1,
        group=LEARNING,
    )
    event_slice: int = declared(
        "FRESHREC_EVENT_SLICE",
        16384,
        "At most this many events learnt between two looks at the request queue.",
        minimum=1,
        group=LEARNING,
    )
    event_slice_ms: float = declared(
        "FRESHREC_EVENT_SLICE_MS",
        10.0,
        "Time budget of one slice of events: a request's longest wait behind learning.",
        positive=True,
        group=LEARNING,
    )
    """The slice holds as many events as fit at the cost per event measured so far."""
    event_slice_idle_ms: float = declared(
        "FRESHREC_EVENT_SLICE_IDLE_MS",
        40.0,
        "The slice's budget while no request has arrived for a second (a backlog is learnt "
        "faster).",
        positive=True,
        group=LEARNING,
    )
    prefetch_purge_ms: float = declared(
        "FRESHREC_PREFETCH_PURGE_MS",
        1000.0,
        "While the worker's consumes come back full, the event partitions pause this often, "
        "dropping their prefetched events (read again later), so a request behind them waits "
        "about this long at most (0: never).",
        minimum=0,
    )
    """``batching.PrefetchPurge``."""
    poll_timeout_ms: int = 5
    fetch_wait_ms: int | None = declared(
        "FRESHREC_WORKER_FETCH_WAIT_MS",
        None,
        "`fetch.wait.max.ms` of the consumer of `events` and `recommend.requests`.",
        kind=int,
        minimum=0,
        shown="the Kafka profile's (10 `local`, 100 `production`)",
    )
    device: str = declared(
        "FRESHREC_DEVICE", "auto", "`auto` (CUDA if available, else CPU), `cpu`, `cuda`, `cuda:1`…"
    )
    table_dtype: str = declared(
        "FRESHREC_TABLE_DTYPE",
        "float32",
        "How the device tables store rows: `float16` halves their memory, computed in float32.",
        choices=STORAGE_DTYPES,
    )
    ranking_dtype: str = declared(
        "FRESHREC_RANKING_DTYPE",
        "float32",
        "How the served ranking models hold their weights: `float16` halves them.",
        choices=STORAGE_DTYPES,
    )
    worker_id: str = declared(
        "FRESHREC_WORKER_ID", "", "The worker's name in logs and metrics.", shown="host-pid"
    )
    metrics_port: int = declared_as(METRICS_PORT)
    redis_timeout_s: float = 0.5
    torch_threads: int = declared(
        "FRESHREC_TORCH_THREADS", 1, "Intra-op CPU threads (0: torch's default).", minimum=0
    )
    """One keeps a busy host's cores for the other processes; batching, not intra-op
    threads, is what makes ranking cheap."""
    commit_interval_s: float = declared(
        "FRESHREC_COMMIT_INTERVAL_S", 0.2, "How often a worker commits what is done.", positive=True
    )
    revoke_flush_s: float = declared(
        "FRESHREC_REVOKE_FLUSH_S",
        10.0,
        "On a rebalance, how long a worker waits for the broker to take what it produced "
        "before taking the rest back.",
        positive=True,
    )
    """``Worker._on_revoke``."""
    # ---- serving
    serving: ServingSettings = field(default_factory=ServingSettings)
    max_batch: int = MAX_BATCH.default
    max_wait_ms: int = MAX_WAIT_MS.default
    model_dir: Path = field(default_factory=model_dir)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    recall_delays_ms: dict[str, float] = field(default_factory=dict)
    """Fault injection: extra latency per recall channel (drills and tests only)."""
    hot_k: int = declared_as(HOT_K)
    hot_weights: HotWeights = field(default_factory=HotWeights)
    hot_decay_per_hour: float = HotScoreSettings.decay_per_hour
    event_time_scale: float = HotScoreSettings.time_scale
    answered_memory: int = 100_000
    recent_users: int = declared(
        "FRESHREC_RECENT_USERS",
        100_000,
        "Users whose last clicks the worker keeps in memory (i2i and co-visitation recall).",
        minimum=1,
    )
    exclude_seen: bool = declared(
        "FRESHREC_EXCLUDE_SEEN",
        True,
        "A request without `exclude_seen` leaves out what its user consumed; `false` declares "
        "a repeat-consumption domain (music plays, groceries).",
    )
    """A client that knows nothing of ``exclude`` does not get back what its user just
    consumed: 5.7 of 10 items a MovieLens user got back were already rated (docs/replay.md)."""
    cold_item_start: bool = declared(
        "FRESHREC_COLD_ITEM_START",
        True,
        "A catalogue item without a learnt row starts from its category's mean learnt row, "
        "here and in Redis; false: from its id.",
        group=LEARNING,
    )
    """``inference/models/coldstart.py``."""
    dedupe_window: int = declared_as(DEDUPE_WINDOW)
    """Event ids remembered per events partition: a duplicate within them is learnt once."""
    seen_users: int = declared(
        "FRESHREC_SEEN_USERS",
        20_000,
        "Users whose consumed items the worker remembers for `exclude_seen` (the most "
        "recently active).",
        minimum=1,
    )
    seen_per_user: int = declared(
        "FRESHREC_SEEN_PER_USER",
        200,
        "Consumed items remembered per such user, the newest (~100 bytes an item).",
        minimum=1,
    )
    answered_ttl_s: int = 3600
    experiments_file: Path | None = None
    """An A/B experiment's declaration (docs/experiments.md): requests get their user's
    variant; None: no experiment."""
    reply_topic_pattern: str | None = declared(
        "FRESHREC_REPLY_TOPIC_PATTERN",
        None,
        "The reply topics a request may name (a regular expression the whole name matches).",
        parse=_pattern,
        shown="the shared reply topic and `recommend.replies.<id>`",
    )
    dead_letters: DeadLetterLimits = field(default_factory=DeadLetterLimits)
    mode: str = DAILY
    """The serving mode at start (``inference/serving/modes.py``); a control record on the
    ``control`` topic switches it while running."""
    modes: dict[str, ModeSettings] = field(default_factory=dict)
    """Every mode's serving settings (the shipped modes and ``FRESHREC_MODES_FILE``'s)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """The worker's settings, with every mode's built from them (a mode whose settings
        are not valid is an error at start, naming the mode)."""
        settings = cls._from_env(env)
        try:
            declared = declared_modes(env)
        except ModeError as exc:
            raise SettingsError(f"FRESHREC_MODES_FILE: {exc}") from None
        start = MODE.read(env)
        if start not in declared:
            raise SettingsError(f"FRESHREC_MODE={start!r}: one of {', '.join(sorted(declared))}")
        modes = {}
        for name, overrides in declared.items():
            try:
                one = cls._from_env(mode_env(env, overrides))
            except SettingsError as exc:
                raise SettingsError(f"mode {name}: {exc}") from None
            modes[name] = ModeSettings(one.serving, one.max_batch, one.max_wait_ms)
        return replace(settings, mode=start, modes=modes)

    @classmethod
    def _from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        rows = RowSettings.from_env(env)
        hot = HotScoreSettings.from_env(env)
        settings = read_settings(
            cls,
            env,
            conn=ConnectionSettings.from_env(env),
            learning=learning_settings(env, rows),
            row_ttl_s=rows.row_ttl_s,
            serving=ServingSettings.from_env(env),
            max_batch=MAX_BATCH.read(env),
            max_wait_ms=MAX_WAIT_MS.read(env),
            model_dir=model_dir(env),
            breaker=breaker(env),
            recall_delays_ms=RECALL_INJECT_DELAY_MS.read(env) or {},
            hot_weights=hot.weights,
            hot_decay_per_hour=hot.decay_per_hour,
            event_time_scale=hot.time_scale,
            dead_letters=dead_letter_limits(env),
            experiments_file=EXPERIMENTS_FILE.read(env),
        )
        if settings.worker_id:
            return settings
        return replace(settings, worker_id=f"{socket.gethostname()}-{os.getpid()}")


def learning_settings(env: Mapping[str, str], rows: RowSettings) -> LearningSettings:
    """The local steps' settings: the environment's, else what the models' manifest
    recommends for rows trained the way they were (``online_defaults``), else the defaults."""
    online = online_defaults(env)
    loss = LEARNING_LOSS.read(env)
    if loss == "auto":
        loss = online.get("loss", LabelConfig.loss)
    if loss not in LOSSES:
        raise SettingsError(f"the models' manifest names loss {loss!r}: one of {LOSSES}")
    lr = LOCAL_LR.read(env, float(online.get("item_lr", LEARNING_RATE)))
    negatives = SAMPLED_NEGATIVES.read(
        env, int(online.get("sampled_negatives", LabelConfig.sampled_negatives))
    )
    return LearningSettings(
        dim=rows.dim,
        lr=lr,
        user_lr=LOCAL_USER_LR.read(env, float(online.get("user_lr", lr))),
        labels=LabelConfig(sampled_negatives=negatives, loss=loss),
        max_grad_norm=rows.max_grad_norm,
        admission_touches=ADMISSION_TOUCHES.read(env),
        admission_window_s=ADMISSION_WINDOW_S.read(env),
        gradient_linger_ms=GRADIENT_LINGER_MS.read(env),
        max_pending_steps=MAX_PENDING_STEPS.read(env),
    )


@dataclass(frozen=True)
class ModeSettings:
    """What a serving mode sets: the serving settings and the batching policy's."""

    serving: ServingSettings
    max_batch: int
    max_wait_ms: int


def served_ranker(env: Mapping[str, str]) -> str:
    """``FRESHREC_RANKER``: the full tier's model (default ``wide_deep``)."""
    return ServingSettings.from_env(env).ranker
