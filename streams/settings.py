"""Settings of ``freshrec streams``, read from the environment at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from freshcore.hotscore import Smoothing
from freshcore.neighbours import MAX_PAIRS, PAIR_WINDOW, PAIR_WINDOW_MS
from freshcore.settings import (
    ConnectionSettings,
    HotScoreSettings,
    SettingsError,
    dead_letter_limits,
    env_float,
    env_int,
    env_optional_int,
    env_str,
)
from schemas.codec import CodecLimits, DeadLetterLimits
from streams.covisit import CoVisitConfig
from streams.item_state import StateConfig


@dataclass(frozen=True)
class StreamsSettings:
    conn: ConnectionSettings
    state: StateConfig = field(default_factory=StateConfig)
    limits: CodecLimits = field(default_factory=CodecLimits)
    hot_k: int = 500
    """Length of each published hot list (global and per region)."""
    recent_clicks: int = 50
    """How many recent clicks are kept per user."""
    recent_ttl_s: int = 30 * 86_400
    """A user's recent clicks leave Redis this long after their last click (0: never);
    ``FRESHREC_ROW_TTL_S``, after which the user's row leaves too."""
    dedupe_window: int = 200_000
    """Event ids remembered per source partition; a replay inside the window counts once."""
    new_item_window_ms: int = 24 * 3_600_000
    """Items created within this window are 'new' (the new-items recall channel)."""
    publish_interval_ms: int = 200
    """How often changed hot lists are recomputed and published."""
    features_interval_ms: int = 1000
    """How often the serving features of the items counted since are written (with a
    publish round): an item counted in several rounds in between is written once."""
    fetch_wait_max_ms: int | None = None
    """faust's consumer fetch wait; None takes the profile's background wait (20 ms local, 100 ms prod)."""
    batch_max: int = 5000
    """Events per validate batch (and by-item records per count batch) at most: a batch
    costs a by-item record per target partition and numpy passes of fixed overhead, so a
    backlog goes faster in large ones; at a steady rate a batch closes after 50 ms anyway."""
    batch_within_ms: int = 20
    metrics_port: int = 0
    """Prometheus port; 0 disables the endpoint."""
    dead_letters: DeadLetterLimits = field(default_factory=DeadLetterLimits)
    """How much of a rejected record its dead letter keeps."""
    covisit: CoVisitConfig = field(default_factory=CoVisitConfig)
    """Co-visitation: which clicks pair, and how many neighbours are kept (``covisit.py``)."""
    validate_process: bool = True
    """The validate stage in a child process of its own (``process``) or on a thread of the
    streams process (``thread``): a process has its own core and GIL."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StreamsSettings:
        hot = HotScoreSettings.from_env(env)
        state = StateConfig(
            decay_rate_per_hour=hot.decay_per_hour,
            late_grace_ms=env_int(env, "FRESHREC_LATE_GRACE_MS", 600_000, minimum=0),
            weights=hot.weights,
            smoothing=Smoothing(),
            price_cap=env_float(env, "FRESHREC_PRICE_CAP", 1000.0, positive=True),
            covisit_candidates=env_int(env, "FRESHREC_COVISIT_CANDIDATES", 200, minimum=4),
            covisit_max_neighbours=env_int(
                env, "FRESHREC_COVISIT_MAX_NEIGHBOURS", 5_000_000, minimum=1
            ),
            evict_below=env_float(env, "FRESHREC_STREAMS_EVICT_BELOW", 0.01, minimum=0.0),
            max_items=env_int(env, "FRESHREC_STREAMS_MAX_ITEMS", 500_000, minimum=10),
        )
        validate = env_str(env, "FRESHREC_STREAMS_VALIDATE", "process")
        if validate not in ("process", "thread"):
            raise SettingsError(
                f"FRESHREC_STREAMS_VALIDATE={validate!r}: must be 'process' or 'thread'"
            )
        return cls(
            conn=ConnectionSettings.from_env(env),
            state=state,
            limits=CodecLimits(
                max_payload_bytes=env_int(env, "FRESHREC_MAX_EVENT_BYTES", 16_384, minimum=256),
                max_clock_skew_ms=env_int(env, "FRESHREC_MAX_CLOCK_SKEW_MS", 600_000, minimum=0),
            ),
            hot_k=env_int(env, "FRESHREC_HOT_K", 500, minimum=1),
            recent_clicks=env_int(env, "FRESHREC_RECENT_CLICKS", 50, minimum=1),
            recent_ttl_s=env_int(env, "FRESHREC_ROW_TTL_S", 30 * 86_400, minimum=0),
            dedupe_window=env_int(env, "FRESHREC_DEDUPE_WINDOW", 200_000, minimum=1),
            new_item_window_ms=env_int(env, "FRESHREC_NEW_ITEM_WINDOW_MS", 86_400_000, minimum=1),
            publish_interval_ms=env_int(env, "FRESHREC_HOT_PUBLISH_MS", 200, minimum=10),
            features_interval_ms=env_int(env, "FRESHREC_FEATURES_WRITE_MS", 1000, minimum=10),
            fetch_wait_max_ms=env_optional_int(env, "FRESHREC_STREAMS_FETCH_WAIT_MS", minimum=0),
            batch_max=env_int(env, "FRESHREC_STREAMS_BATCH_MAX", 5000, minimum=1),
            metrics_port=env_int(env, "FRESHREC_METRICS_PORT", 0, minimum=0),
            validate_process=validate == "process",
            covisit=CoVisitConfig(
                window=env_int(env, "FRESHREC_COVISIT_WINDOW", PAIR_WINDOW, minimum=1),
                window_ms=env_int(env, "FRESHREC_COVISIT_WINDOW_MS", PAIR_WINDOW_MS, minimum=1),
                max_pairs=env_int(env, "FRESHREC_COVISIT_MAX_PAIRS", MAX_PAIRS, minimum=0),
                users=env_int(env, "FRESHREC_COVISIT_USERS", 100_000, minimum=1),
                candidates=env_int(env, "FRESHREC_COVISIT_CANDIDATES", 200, minimum=4),
                neighbours=env_int(env, "FRESHREC_COVISIT_NEIGHBOURS", 50, minimum=1),
            ),
            dead_letters=dead_letter_limits(env),
        )
