"""Settings of ``freshrec worker``, read from the environment at the edge."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from freshcore.hotscore import HotWeights
from freshcore.settings import (
    LEARNING_RATE,
    ConnectionSettings,
    HotScoreSettings,
    RowSettings,
    SettingsError,
    dead_letter_limits,
    env_bool,
    env_float,
    env_int,
    env_optional_int,
    model_dir,
    online_defaults,
)
from inference.device import STORAGE_DTYPES
from inference.learning.learner import LearningSettings
from inference.learning.steps import LOSSES, LabelConfig
from inference.models.kinds import served_rankers
from inference.models.tiers import HeatSplit
from inference.serving.breaker import BreakerConfig
from inference.serving.channels import default_channels, parse_delays, parse_quotas
from inference.serving.degrade import LadderConfig
from inference.serving.modes import DAILY, ModeError, declared_modes, mode_env
from inference.serving.recommender import ServingSettings
from schemas.codec import DeadLetterLimits


@dataclass(frozen=True)
class WorkerSettings:
    conn: ConnectionSettings
    learning: LearningSettings = field(default_factory=LearningSettings)
    user_capacity_rows: int = 200_000
    host_user_rows: int = 500_000
    """User rows host RAM holds after the device slab lets them go (the cache's second level,
    ``inference/tables/host.py``; 0: none). ``FRESHREC_HOST_USER_ROWS``."""
    host_item_rows: int = 200_000
    """Item rows host RAM holds after the size bound lets them go. ``FRESHREC_HOST_ITEM_ROWS``."""
    row_ttl_s: int = 30 * 86_400
    """Item rows that no event and no broadcast update has touched this long leave the item
    table, unless the catalogue lists them (0: never). The parameter server's setting of the
    same name lets such rows expire in Redis and leave its memory."""
    max_item_rows: int = 2_000_000
    """Item rows the table holds at most beyond those the catalogue lists: past it, the least
    recently touched leave (``EmbeddingCache.evict_items``), so a flood of unknown item ids
    in events cannot grow the worker without bound. ``FRESHREC_MAX_ITEM_ROWS``."""
    batch_max: int = 2000
    """Messages per consume call."""
    event_slice: int = 16384
    """At most this many events learnt between two looks at the request queue."""
    event_slice_ms: float = 10.0
    """Time budget of one slice of events (bounds a request's wait behind learning): the
    slice holds as many events as fit at the cost per event measured so far."""
    event_slice_idle_ms: float = 40.0
    """The budget while no request has arrived for a second: only the first request after
    the quiet waits behind such a slice, and a backlog is learnt faster."""
    prefetch_purge_ms: float = 1000.0
    """While the worker's consumes come back full (events wait in the client's queue), the
    event partitions pause this often, dropping their prefetched events (read again later),
    so a request behind them waits about this long at most (``batching.PrefetchPurge``; 0:
    never). ``FRESHREC_PREFETCH_PURGE_MS``."""
    poll_timeout_ms: int = 5
    fetch_wait_ms: int | None = None
    """``fetch.wait.max.ms`` of the events-and-requests consumer (None: the Kafka profile's
    ``worker_fetch_wait_ms``, 10 ms ``local``, 100 ms ``production``)."""
    device: str = "auto"
    table_dtype: str = "float32"
    """How the device tables store rows: ``float16`` halves their memory, computed in float32
    (``FRESHREC_TABLE_DTYPE``; ``inference/tables/cache.py``)."""
    ranking_dtype: str = "float32"
    """How the served ranking models hold their weights (``FRESHREC_RANKING_DTYPE``;
    ``inference/models/ranking.py``)."""
    worker_id: str = ""
    metrics_port: int = 0
    redis_timeout_s: float = 0.5
    torch_threads: int = 1
    """Intra-op CPU threads (0: torch's default). One keeps a busy host's cores for the other
    processes; batching, not intra-op threads, is what makes ranking cheap."""
    commit_interval_s: float = 0.2
    revoke_flush_s: float = 10.0
    """On a rebalance, how long the worker waits for the broker to take what it produced for
    the partitions it gives up before taking the rest back (``Worker._on_revoke``)."""
    # ---- serving
    serving: ServingSettings = field(default_factory=ServingSettings)
    max_batch: int = 32
    max_wait_ms: int = 0
    model_dir: Path = field(default_factory=model_dir)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    recall_delays_ms: dict[str, float] = field(default_factory=dict)
    """Fault injection: extra latency per recall channel (drills and tests only)."""
    hot_k: int = 500
    hot_weights: HotWeights = field(default_factory=HotWeights)
    hot_decay_per_hour: float = 0.95
    answered_memory: int = 100_000
    recent_users: int = 100_000
    """Users whose last clicks the worker keeps in memory (i2i recall)."""
    exclude_seen: bool = True
    """A request without ``exclude_seen`` leaves out what its user consumed: on by default (a
    client that knows nothing of ``exclude`` does not get back what its user just consumed:
    5.7 of 10 items a MovieLens user got back were already rated, docs/replay.md); a
    deployment whose users consume the same items again (music plays, groceries) declares it
    with ``FRESHREC_EXCLUDE_SEEN=false``."""
    cold_item_start: bool = True
    """Catalogue items without a learnt row start from their category's mean learnt row,
    written to Redis for the parameter server and the other workers
    (``inference/models/coldstart.py``); false: from their ids."""
    dedupe_window: int = 200_000
    """Event ids remembered per events partition: a duplicate within them is learnt once."""
    seen_users: int = 20_000
    seen_per_user: int = 200
    """The consumed items the worker remembers for ``exclude_seen``: per user, the newest
    this many, for the most recently active ``seen_users`` users (~100 bytes an item)."""
    answered_ttl_s: int = 3600
    experiments_file: Path | None = None
    """An A/B experiment's declaration (``FRESHREC_EXPERIMENTS_FILE``; docs/experiments.md):
    requests get their user's variant; None: no experiment."""
    reply_topic_pattern: str | None = None
    """The reply topics a request may name (a regular expression the whole name matches;
    None: the shared reply topic and clients' own ``recommend.replies.<id>``)."""
    dead_letters: DeadLetterLimits = field(default_factory=DeadLetterLimits)
    mode: str = DAILY
    """The serving mode at start (``FRESHREC_MODE``; ``inference/serving/modes.py``); a control
    record on the ``control`` topic switches it while running."""
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
        start = env.get("FRESHREC_MODE") or DAILY
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
        models = model_dir(env)
        online = online_defaults(env)
        loss = env.get("FRESHREC_LEARNING_LOSS", "auto") or "auto"
        if loss == "auto":
            loss = online.get("loss", "logistic")
        if loss not in LOSSES:
            raise SettingsError(f"FRESHREC_LEARNING_LOSS must be auto or one of {LOSSES}")
        lr = env_float(
            env, "FRESHREC_LOCAL_LR", float(online.get("item_lr", LEARNING_RATE)), minimum=0
        )
        learning = LearningSettings(
            dim=rows.dim,
            lr=lr,
            user_lr=env_float(
                env, "FRESHREC_LOCAL_USER_LR", float(online.get("user_lr", lr)), minimum=0
            ),
            labels=LabelConfig(
                sampled_negatives=env_int(
                    env,
                    "FRESHREC_SAMPLED_NEGATIVES",
                    int(online.get("sampled_negatives", 2)),
                    minimum=0,
                ),
                loss=loss,
            ),
            max_grad_norm=rows.max_grad_norm,
            admission_touches=env_int(env, "FRESHREC_ADMISSION_TOUCHES", 1, minimum=1),
            admission_window_s=env_int(env, "FRESHREC_ADMISSION_WINDOW_S", 3600, minimum=1),
            gradient_linger_ms=env_int(env, "FRESHREC_GRADIENT_LINGER_MS", 100, minimum=0),
            max_pending_steps=env_int(env, "FRESHREC_MAX_PENDING_STEPS", 1_000_000, minimum=1_000),
        )
        channels = default_channels()
        enabled = env.get("FRESHREC_RECALL_CHANNELS")
        if enabled:
            wanted = [c.strip() for c in enabled.split(",") if c.strip()]
            unknown = [c for c in wanted if c not in channels]
            if unknown:
                raise SettingsError(f"FRESHREC_RECALL_CHANNELS: unknown channel(s) {unknown}")
            channels = {c: channels[c] for c in wanted}
        scale = env_float(env, "FRESHREC_RECALL_DEADLINE_SCALE", 1.0, positive=True)
        channels = {k: replace(v, deadline_ms=v.deadline_ms * scale) for k, v in channels.items()}
        try:
            quotas = parse_quotas(env.get("FRESHREC_RECALL_QUOTAS", ""))
        except ValueError as exc:
            raise SettingsError(f"FRESHREC_RECALL_QUOTAS: {exc}") from None
        channels = {k: replace(v, quota=quotas.get(k, v.quota)) for k, v in channels.items()}
        serving = ServingSettings(
            candidates=env_int(env, "FRESHREC_CANDIDATES", 500, minimum=1),
            default_budget_ms=env_int(env, "FRESHREC_REQUEST_BUDGET_MS", 250, minimum=1),
            mmr_lambda=env_float(env, "FRESHREC_MMR_LAMBDA", 0.7, minimum=0, maximum=1),
            category_gap=env_int(env, "FRESHREC_CATEGORY_GAP", 2, minimum=1),
            hold_shown_s=env_float(env, "FRESHREC_HOLD_SHOWN_S", 0.0, minimum=0),
            channels=channels,
            ladder=LadderConfig(
                queue_depth_limit=env_int(env, "FRESHREC_QUEUE_DEPTH_LIMIT", 256, minimum=1)
            ),
            result_ttl_ms=env_int(env, "FRESHREC_RESULT_TTL_MS", 3_600_000, minimum=1),
            ann_min_items=env_int(env, "FRESHREC_ANN_MIN_ITEMS", 200_000, minimum=1),
            ann_nprobe=env_int(env, "FRESHREC_ANN_NPROBE", 0, minimum=0),
            ann_refresh_s=env_float(env, "FRESHREC_ANN_REFRESH_S", 300.0, positive=True),
            ranker=served_ranker(env),
            heat_split=heat_split(env),
        )
        try:
            delays = parse_delays(env.get("FRESHREC_RECALL_INJECT_DELAY_MS", ""))
        except ValueError as exc:
            raise SettingsError(f"FRESHREC_RECALL_INJECT_DELAY_MS: {exc}") from None
        return cls(
            conn=ConnectionSettings.from_env(env),
            learning=learning,
            user_capacity_rows=env_int(env, "FRESHREC_USER_CACHE_ROWS", 200_000, minimum=1),
            host_user_rows=env_int(env, "FRESHREC_HOST_USER_ROWS", 500_000, minimum=0),
            host_item_rows=env_int(env, "FRESHREC_HOST_ITEM_ROWS", 200_000, minimum=0),
            row_ttl_s=rows.row_ttl_s,
            max_item_rows=env_int(env, "FRESHREC_MAX_ITEM_ROWS", 2_000_000, minimum=1),
            batch_max=env_int(env, "FRESHREC_WORKER_BATCH_MAX", 2000, minimum=1),
            event_slice=env_int(env, "FRESHREC_EVENT_SLICE", 16384, minimum=1),
            event_slice_ms=env_float(env, "FRESHREC_EVENT_SLICE_MS", 10.0, positive=True),
            event_slice_idle_ms=env_float(env, "FRESHREC_EVENT_SLICE_IDLE_MS", 40.0, positive=True),
            prefetch_purge_ms=env_float(env, "FRESHREC_PREFETCH_PURGE_MS", 1000.0, minimum=0.0),
            fetch_wait_ms=env_optional_int(env, "FRESHREC_WORKER_FETCH_WAIT_MS", minimum=0),
            torch_threads=env_int(env, "FRESHREC_TORCH_THREADS", 1, minimum=0),
            revoke_flush_s=env_float(env, "FRESHREC_REVOKE_FLUSH_S", 10.0, positive=True),
            commit_interval_s=env_float(env, "FRESHREC_COMMIT_INTERVAL_S", 0.2, positive=True),
            device=env.get("FRESHREC_DEVICE", "auto") or "auto",
            table_dtype=storage_dtype(env, "FRESHREC_TABLE_DTYPE"),
            ranking_dtype=storage_dtype(env, "FRESHREC_RANKING_DTYPE"),
            worker_id=env.get("FRESHREC_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}",
            metrics_port=env_int(env, "FRESHREC_METRICS_PORT", 0, minimum=0),
            serving=serving,
            max_batch=env_int(env, "FRESHREC_MAX_BATCH", 32, minimum=1),
            max_wait_ms=env_int(env, "FRESHREC_MAX_WAIT_MS", 0, minimum=0),
            model_dir=models,
            breaker=BreakerConfig(
                threshold=env_float(
                    env, "FRESHREC_BREAKER_THRESHOLD", 0.10, positive=True, maximum=1
                ),
                cooldown_ms=env_int(env, "FRESHREC_BREAKER_COOLDOWN_MS", 2000, minimum=1),
            ),
            recall_delays_ms=delays,
            hot_k=env_int(env, "FRESHREC_HOT_K", 500, minimum=1),
            exclude_seen=env_bool(env, "FRESHREC_EXCLUDE_SEEN", True),
            cold_item_start=env_bool(env, "FRESHREC_COLD_ITEM_START", True),
            seen_users=env_int(env, "FRESHREC_SEEN_USERS", 20_000, minimum=1),
            recent_users=env_int(env, "FRESHREC_RECENT_USERS", 100_000, minimum=1),
            dedupe_window=env_int(env, "FRESHREC_DEDUPE_WINDOW", 200_000, minimum=1),
            seen_per_user=env_int(env, "FRESHREC_SEEN_PER_USER", 200, minimum=1),
            hot_weights=hot.weights,
            hot_decay_per_hour=hot.decay_per_hour,
            reply_topic_pattern=_reply_pattern(env),
            dead_letters=dead_letter_limits(env),
            experiments_file=Path(env["FRESHREC_EXPERIMENTS_FILE"])
            if env.get("FRESHREC_EXPERIMENTS_FILE")
            else None,
        )


@dataclass(frozen=True)
class ModeSettings:
    """What a serving mode sets: the serving settings and the batching policy's."""

    serving: ServingSettings
    max_batch: int
    max_wait_ms: int


def _reply_pattern(env: Mapping[str, str]) -> str | None:
    pattern = env.get("FRESHREC_REPLY_TOPIC_PATTERN") or None
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SettingsError(f"FRESHREC_REPLY_TOPIC_PATTERN={pattern!r}: {exc}") from None
    return pattern


SERVED_RANKERS = served_rankers()
"""What ``FRESHREC_RANKER`` accepts (``inference/models/kinds.py``)."""


def served_ranker(env: Mapping[str, str]) -> str:
    """``FRESHREC_RANKER``: the full tier's model (default ``wide_deep``)."""
    name = env.get("FRESHREC_RANKER", "") or "wide_deep"
    if name not in SERVED_RANKERS:
        raise SettingsError(f"FRESHREC_RANKER must be one of {', '.join(SERVED_RANKERS)}")
    return name


def storage_dtype(env: Mapping[str, str], name: str) -> str:
    """A storage dtype setting: ``float32`` (the default) or ``float16``."""
    value = env.get(name, "") or "float32"
    if value not in STORAGE_DTYPES:
        raise SettingsError(f"{name} must be one of {', '.join(STORAGE_DTYPES)}, got {value!r}")
    return value


def heat_split(env: Mapping[str, str]) -> HeatSplit:
    """``FRESHREC_TIER_HEAD_SHARE`` and ``FRESHREC_TIER_MID_SHARE``: the ``tiered`` ranker's
    shares of the warm catalogue by heat (defaults 0.1 and 0.3)."""
    head = env_float(env, "FRESHREC_TIER_HEAD_SHARE", 0.1, minimum=0, maximum=1)
    middle = env_float(env, "FRESHREC_TIER_MID_SHARE", 0.3, minimum=0, maximum=1)
    try:
        return HeatSplit(head, middle)
    except ValueError as exc:
        raise SettingsError(f"FRESHREC_TIER_HEAD_SHARE/FRESHREC_TIER_MID_SHARE: {exc}") from None
