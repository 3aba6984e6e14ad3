"""The worker's parts, built in dependency order: each is given what it needs when it is
built, and none is told of another after the fact (no hook patched in, no setting changed
from outside).

The order (``build_parts``): the connections (``WorkerClients``, built at the edge), the
gradients partitions; the step pool, the offset gate and the outbox (what the cache's
evictions reach); the cache (its rows fetched from Redis, its evictions forgetting their
steps), the sender and the update installer; each user's recent clicks and seen items (what
learning writes and serving reads); the serving snapshot, the models (their loads counted)
and the experiment; the recommender (which holds the ranking stage and the recall runner);
the learner (which reads the recommender's catalogue slots); the intake (which serves
through the recommender); the serving mode (which switches the recommender and the intake,
each through its own ``use``); the offset committer (the gate's and the intake's offsets).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from freshcore import metrics as m
from freshcore.kafka import partition_count
from freshcore.rediskeys import RedisKeys
from freshcore.rowstore import fetch_rows, seed_starts
from freshcore.topics import TopicNames
from inference.clients import WorkerClients
from inference.commits import OffsetCommitter
from inference.device import STORAGE_DTYPES, pick_device
from inference.intake import RequestIntake
from inference.learning.admission import AdmissionFilter
from inference.learning.learner import LocalLearner
from inference.learning.outbox import GradientOutbox
from inference.learning.pending import PendingSteps
from inference.learning.sender import GradientSender
from inference.learning.updates import UpdateInstaller
from inference.models.modelfile import ModelSet, ModelWatcher
from inference.offsets import OffsetGate
from inference.serving.channels import make_channels
from inference.serving.liveexperiment import LiveExperiment
from inference.serving.livemode import LiveMode
from inference.serving.recall import RecallRunner
from inference.serving.recommender import Recommender
from inference.serving.snapshot import SnapshotRefresher
from inference.settings import ModeSettings, WorkerSettings
from inference.tables.cache import EmbeddingCache
from inference.tables.recent import RecentClicks, with_seen
from schemas.rows import width

MAX_ROWS_PER_MESSAGE = 1000
OUTBOX_MAX_ROWS = 20_000  # sent before the linger runs out past this many waiting rows
STEP_POOL_ENTRIES = 1 << 17
"""Local steps the pool holds at first (~40 MB written at once, not page by page inside the
first slices); it grows past that."""


@dataclass
class WorkerParts:
    """What the worker's loop drives, each part built by ``build_parts``."""

    names: TopicNames
    keys: RedisKeys
    stats: dict[str, int]
    """Events learnt, invalid and duplicate, local steps let go: what a test or a drill can
    read (the learner counts into it too)."""
    pending: PendingSteps
    gate: OffsetGate
    """Learnt events' offsets, held until their gradients are delivered."""
    outbox: GradientOutbox
    cache: EmbeddingCache
    sender: GradientSender
    installer: UpdateInstaller
    recent: RecentClicks
    seen: RecentClicks
    snapshots: SnapshotRefresher
    models: ModelWatcher
    experiment: LiveExperiment | None
    recommender: Recommender
    learner: LocalLearner
    intake: RequestIntake
    mode: LiveMode
    commits: OffsetCommitter


def build_parts(settings: WorkerSettings, clients: WorkerClients) -> WorkerParts:
    """The worker's parts, each built after what it reads (the module's docstring)."""
    names = TopicNames(settings.conn.topic_prefix)
    keys = RedisKeys(settings.conn.topic_prefix)
    partitions = partition_count(clients.producer, names.gradients)
    stats = {"events": 0, "invalid": 0, "duplicates": 0, "pending_let_go": 0}
    pending = PendingSteps(
        capacity=STEP_POOL_ENTRIES, width=width(settings.learning.dim), touch=True
    )
    gate = OffsetGate()
    outbox = _outbox(settings, partitions)
    cache = _cache(settings, clients, keys, partitions, pending, outbox)
    m.DEVICE_INFO.labels(str(cache.device)).set(1)  # a GPU held is a GPU paid for
    sender = GradientSender(clients.producer, names.gradients, pending, gate, cache)
    installer = UpdateInstaller(cache, pending, clients.producer)
    # what learning writes and serving reads: built before both
    recent = RecentClicks(settings.recent_users)
    seen = RecentClicks(settings.seen_users, settings.seen_per_user)
    snapshots = _snapshots(settings, clients, keys)
    models = ModelWatcher(
        settings.model_dir,
        cache.device,
        settings.learning.dim,
        settings.ranking_dtype,
        on_change=count_models,
    )
    experiment = _experiment(settings, clients, keys)
    recommender = _recommender(
        settings, clients, keys, partitions, cache, snapshots, models, recent, seen, experiment
    )
    learner = _learner(settings, cache, pending, outbox, recent, seen, recommender, stats)
    intake = RequestIntake(
        settings, names, keys, clients.redis, clients.producer, recommender, experiment
    )
    mode = _live_mode(settings, recommender, intake)
    commits = OffsetCommitter(
        clients.events, names.events, names.recommend_requests, gate, intake.offsets
    )
    return WorkerParts(
        names,
        keys,
        stats,
        pending,
        gate,
        outbox,
        cache,
        sender,
        installer,
        recent,
        seen,
        snapshots,
        models,
        experiment,
        recommender,
        learner,
        intake,
        mode,
        commits,
    )


def _snapshots(
    settings: WorkerSettings, clients: WorkerClients, keys: RedisKeys
) -> SnapshotRefresher:
    """The serving snapshot (hot lists, features, the catalogue), refreshed from Redis."""
    return SnapshotRefresher(
        clients.redis,
        keys,
        settings.hot_k,
        weights=settings.hot_weights,
        rate_per_hour=settings.hot_decay_per_hour,
        time_scale=settings.event_time_scale,
    )


def _experiment(
    settings: WorkerSettings, clients: WorkerClients, keys: RedisKeys
) -> LiveExperiment | None:
    """The A/B experiment of ``FRESHREC_EXPERIMENTS_FILE``, if one is declared (loaded at
    start: ``Worker.start``)."""
    if not settings.experiments_file:
        return None
    return LiveExperiment(settings.experiments_file, clients.redis, keys, settings.answered_ttl_s)


def _learner(
    settings: WorkerSettings,
    cache: EmbeddingCache,
    pending: PendingSteps,
    outbox: GradientOutbox,
    recent: RecentClicks,
    seen: RecentClicks,
    recommender: Recommender,
    stats: dict[str, int],
) -> LocalLearner:
    """The local learner: steps on the cache's rows, remembered in the pool, gradients into
    the outbox; it writes each user's recent clicks and seen items, and draws the softmax
    loss's negatives from the recommender's catalogue."""
    return LocalLearner(
        settings.learning,
        cache,
        pending,
        outbox,
        recent,
        seen,
        lambda: recommender.slot_of,  # the catalogue's slots, as the latest snapshot has them
        stats,
        seed=abs(hash(settings.worker_id)) % (2**32),
    )


def _outbox(settings: WorkerSettings, partitions: int) -> GradientOutbox:
    """The outbox: gradients summed per row until their linger runs out, rows admitted once
    they are touched often enough."""
    learning = settings.learning
    return GradientOutbox(
        partitions,
        AdmissionFilter(learning.admission_touches, learning.admission_window_s * 1000),
        learning.gradient_linger_ms,
        OUTBOX_MAX_ROWS,
        MAX_ROWS_PER_MESSAGE,
    )


def _cache(
    settings: WorkerSettings,
    clients: WorkerClients,
    keys: RedisKeys,
    partitions: int,
    pending: PendingSteps,
    outbox: GradientOutbox,
) -> EmbeddingCache:
    """The embedding cache: misses fetched from Redis (rows sharded by the gradients
    partitions), evicted rows forgetting their local steps."""
    dim = settings.learning.dim

    def fetch(table: int, ids: list[int]):
        return fetch_rows(clients.redis, keys, table, ids, dim + 1, partitions)

    return EmbeddingCache(
        dim,
        settings.user_capacity_rows,
        fetch,
        pick_device(settings.device),
        host_users=settings.host_user_rows,
        host_items=settings.host_item_rows,
        dtype=STORAGE_DTYPES[settings.table_dtype],
        on_evict=functools.partial(forget_evicted, pending, outbox),
    )


def _recommender(
    settings: WorkerSettings,
    clients: WorkerClients,
    keys: RedisKeys,
    partitions: int,
    cache: EmbeddingCache,
    snapshots: SnapshotRefresher,
    models: ModelWatcher,
    recent: RecentClicks,
    seen: RecentClicks,
    experiment: LiveExperiment | None,
) -> Recommender:
    """The recommender over the cache, reading each user's recent clicks and seen items and
    the experiment's arms; new catalogue items start in Redis where cold starts are on."""
    sv = settings.serving
    return Recommender(
        sv,
        cache,
        clients.redis,
        keys,
        snapshots,
        models,
        lambda state: RecallRunner(
            make_channels(sv.channels, state),
            sv.channels,
            settings.breaker,
            settings.recall_delays_ms,
        ),
        settings.worker_id,
        recent_clicks=recent.get,
        sequence=lambda user_id: seen.get(user_id) or recent.get(user_id),
        seen=lambda r: with_seen(r, seen.get, settings.exclude_seen),
        arm_of=experiment.arm if experiment else lambda user_id: None,
        start_items=(
            functools.partial(seed_starts, clients.redis, keys, partitions)
            if settings.cold_item_start
            else None
        ),
    )


def _live_mode(
    settings: WorkerSettings, recommender: Recommender, intake: RequestIntake
) -> LiveMode:
    """The serving mode, in use from here on: its serving settings go to the recommender,
    its batching to the intake (the worker's one mode, from its settings, where none are
    declared)."""
    modes = settings.modes or {
        settings.mode: ModeSettings(settings.serving, settings.max_batch, settings.max_wait_ms)
    }
    return LiveMode(modes, settings.mode, mode_switch(recommender, intake))


def mode_switch(
    recommender: Recommender, intake: RequestIntake
) -> Callable[[str, ModeSettings], None]:
    """What puts a serving mode in use (``LiveMode``'s ``apply``): the recommender serves with
    its serving settings, the intake batches by its policy, each through its own ``use``."""

    def use(name: str, mode: ModeSettings) -> None:
        recommender.use(mode.serving, name)
        intake.use(mode)

    return use


def forget_evicted(
    pending: PendingSteps, outbox: GradientOutbox, table: int, slots: np.ndarray, ids: list[int]
) -> None:
    """Rows left the user slab or the item table (``EmbeddingCache.on_evict``): their local
    steps go with them (the pool reuses their entries). A row's gradients held back for
    admission stay, to be sent on admission, but no longer name those steps."""
    pending.forget(table, slots)
    outbox.forget_steps(table, ids)


def count_models(models: ModelSet) -> None:
    """A model set was loaded (at start, or a newer one later: ``ModelWatcher.on_change``):
    ``freshrec_model_info`` names its version alone, ``freshrec_model_reloads_total`` counts
    it."""
    m.MODEL_INFO.clear()
    m.MODEL_INFO.labels(models.version).set(1)
    m.MODEL_RELOADS.labels("ok").inc()
