"""Settings of ``freshrec streams``, read from the environment at the edge.

The count stage's, co-visitation's and the sequential rules' defaults are their configs' own
(``StateConfig``, ``CoVisitConfig``, the codec's ``CodecLimits``); each setting that changes
one is declared here once, with that default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from freshcore.declare import Setting, declared, declared_as, read_settings
from freshcore.hotscore import Smoothing
from freshcore.settings import (
    DEDUPE_WINDOW,
    HOT_K,
    METRICS_PORT,
    ROW_TTL_S,
    ConnectionSettings,
    HotScoreSettings,
    dead_letter_limits,
)
from schemas.codec import CodecLimits, DeadLetterLimits
from streams.covisit import CoVisitConfig
from streams.item_state import StateConfig

LATE_GRACE_MS = Setting(
    "FRESHREC_LATE_GRACE_MS",
    StateConfig.late_grace_ms,
    "An event this far behind the count stage's event time is counted as late and dropped.",
    kind=int,
    minimum=0,
)
WATERMARK_IDLE_MS = Setting(
    "FRESHREC_WATERMARK_IDLE_MS",
    StateConfig.watermark_idle_ms,
    "A partition of `events` that has delivered nothing to a count partition for this long "
    "(processing time) stops holding back the event time lateness is judged by.",
    kind=int,
    minimum=0,
)
PRICE_CAP = Setting(
    "FRESHREC_PRICE_CAP",
    StateConfig.price_cap,
    "Prices are normalised as log1p(price) / log1p(cap), clipped to [0, 1].",
    kind=float,
    positive=True,
)
COVISIT_CANDIDATES = Setting(
    "FRESHREC_COVISIT_CANDIDATES",
    StateConfig.covisit_candidates,
    "Co-visitation neighbours counted per anchor (the weakest quarter dropped when full).",
    kind=int,
    minimum=4,
)
COVISIT_MAX_NEIGHBOURS = Setting(
    "FRESHREC_COVISIT_MAX_NEIGHBOURS",
    StateConfig.covisit_max_neighbours,
    "Co-visitation neighbours counted over all the anchors of one `events.by_item` "
    "partition; past it the longest rows are cut.",
    kind=int,
    minimum=1,
)
EVICT_BELOW = Setting(
    "FRESHREC_STREAMS_EVICT_BELOW",
    StateConfig.evict_below,
    "An item whose decayed events (all regions) fall below this leaves the count stage's "
    "state, its Redis rows, features and co-visitation list.",
    kind=float,
    minimum=0,
)
MAX_ITEMS = Setting(
    "FRESHREC_STREAMS_MAX_ITEMS",
    StateConfig.max_items,
    "Items one `events.by_item` partition holds at most; past it the least active leave, "
    "down to nine tenths.",
    kind=int,
    minimum=10,
)
MAX_EVENT_BYTES = Setting(
    "FRESHREC_MAX_EVENT_BYTES",
    CodecLimits.max_payload_bytes,
    "An event larger than this is refused (dead letter `too_large`).",
    kind=int,
    minimum=256,
)
MAX_CLOCK_SKEW_MS = Setting(
    "FRESHREC_MAX_CLOCK_SKEW_MS",
    CodecLimits.max_clock_skew_ms,
    "How far in the future an event time may lie (producer clocks drift).",
    kind=int,
    minimum=0,
)
COVISIT_WINDOW = Setting(
    "FRESHREC_COVISIT_WINDOW",
    CoVisitConfig.window,
    "A click pairs with the user's last this many distinct clicked items.",
    kind=int,
    minimum=1,
)
COVISIT_WINDOW_MS = Setting(
    "FRESHREC_COVISIT_WINDOW_MS",
    CoVisitConfig.window_ms,
    "A click pairs only with items clicked less than this long before.",
    kind=int,
    minimum=1,
)
COVISIT_MAX_PAIRS = Setting(
    "FRESHREC_COVISIT_MAX_PAIRS",
    CoVisitConfig.max_pairs,
    "Pairs one click makes at most, newest first (0: no co-visitation).",
    kind=int,
    minimum=0,
)
COVISIT_USERS = Setting(
    "FRESHREC_COVISIT_USERS",
    CoVisitConfig.users,
    "Users whose windows the validate stage keeps in memory.",
    kind=int,
    minimum=1,
)
COVISIT_NEIGHBOURS = Setting(
    "FRESHREC_COVISIT_NEIGHBOURS",
    CoVisitConfig.neighbours,
    "Co-visitation neighbours published per anchor, best first.",
    kind=int,
    minimum=1,
)
SEQUEL_STEPS = Setting(
    "FRESHREC_SEQUEL_STEPS",
    CoVisitConfig.sequel_steps,
    "A click follows the user's last this many items of their sequence: a sequential rule "
    "a → b weighted 1/d at distance d (0: no sequential rules).",
    kind=int,
    minimum=0,
)
SEQUEL_CANDIDATES = Setting(
    "FRESHREC_SEQUEL_CANDIDATES",
    StateConfig.sequel_candidates,
    "Sequential-rule successors counted per anchor (the weakest quarter dropped when full).",
    kind=int,
    minimum=4,
)
SEQUEL_MAX_SUCCESSORS = Setting(
    "FRESHREC_SEQUEL_MAX_SUCCESSORS",
    StateConfig.sequel_max_successors,
    "Sequential-rule successors counted over all the anchors of one `events.by_item` "
    "partition; past it the longest rows are cut.",
    kind=int,
    minimum=1,
)
SEQUEL_SUCCESSORS = Setting(
    "FRESHREC_SEQUEL_SUCCESSORS",
    CoVisitConfig.sequel_successors,
    "Sequential-rule successors published per anchor, best first.",
    kind=int,
    minimum=1,
)


@dataclass(frozen=True)
class StreamsSettings:
    conn: ConnectionSettings = field(default_factory=ConnectionSettings)
    state: StateConfig = field(default_factory=StateConfig)
    limits: CodecLimits = field(default_factory=CodecLimits)
    hot_k: int = declared_as(HOT_K)
    """Length of each published hot list (global and per region)."""
    recent_clicks: int = declared(
        "FRESHREC_RECENT_CLICKS", 50, "Recent clicks kept per user (in Redis).", minimum=1
    )
    recent_ttl_s: int = declared_as(ROW_TTL_S)
    """A user's recent clicks leave Redis this long after their last click (0: never),
    as the user's row does."""
    dedupe_window: int = declared_as(DEDUPE_WINDOW)
    """Event ids remembered per source partition; a replay inside the window counts once."""
    new_item_window_ms: int = declared(
        "FRESHREC_NEW_ITEM_WINDOW_MS",
        24 * 3_600_000,
        "Items created within this window are new (the `new` recall channel).",
        minimum=1,
    )
    publish_interval_ms: int = declared(
        "FRESHREC_HOT_PUBLISH_MS",
        200,
        "How often changed hot lists are recomputed and published (a round that took longer "
        "than half of this delays the next by its own duration).",
        minimum=10,
    )
    features_interval_ms: int = declared(
        "FRESHREC_FEATURES_WRITE_MS",
        1000,
        "How often the serving features of the items counted since are written (with a "
        "publish round): an item counted in several rounds in between is written once.",
        minimum=10,
    )
    fetch_wait_max_ms: int | None = declared(
        "FRESHREC_STREAMS_FETCH_WAIT_MS",
        None,
        "faust's consumer fetch wait.",
        kind=int,
        minimum=0,
        shown="the Kafka profile's background wait",
    )
    batch_max: int = declared(
        "FRESHREC_STREAMS_BATCH_MAX",
        5000,
        "Events per validate batch (and by-item records per count batch) at most; at a "
        "steady rate a batch closes after 50 ms anyway.",
        minimum=1,
    )
    """A batch costs a by-item record per target partition and numpy passes of fixed
    overhead, so a backlog goes faster in large ones."""
    batch_within_ms: int = 20
    metrics_port: int = declared_as(METRICS_PORT)
    dead_letters: DeadLetterLimits = field(default_factory=DeadLetterLimits)
    """How much of a rejected record its dead letter keeps."""
    covisit: CoVisitConfig = field(default_factory=CoVisitConfig)
    """Co-visitation: which clicks pair, and how many neighbours are kept (``covisit.py``)."""
    validate_process: bool = declared(
        "FRESHREC_STREAMS_VALIDATE",
        True,
        "The validate stage in a child process of its own (`process`: its own core and GIL) "
        "or on a thread of the streams process (`thread`).",
        parse=lambda raw: _validate_where(raw),
        shown="`process`",
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StreamsSettings:
        hot = HotScoreSettings.from_env(env)
        candidates = COVISIT_CANDIDATES.read(env)
        state = StateConfig(
            decay_rate_per_hour=hot.decay_per_hour,
            time_scale=hot.time_scale,
            late_grace_ms=LATE_GRACE_MS.read(env),
            watermark_idle_ms=WATERMARK_IDLE_MS.read(env),
            weights=hot.weights,
            smoothing=Smoothing(),
            price_cap=PRICE_CAP.read(env),
            covisit_candidates=candidates,
            covisit_max_neighbours=COVISIT_MAX_NEIGHBOURS.read(env),
            sequel_candidates=SEQUEL_CANDIDATES.read(env),
            sequel_max_successors=SEQUEL_MAX_SUCCESSORS.read(env),
            evict_below=EVICT_BELOW.read(env),
            max_items=MAX_ITEMS.read(env),
        )
        return read_settings(
            cls,
            env,
            conn=ConnectionSettings.from_env(env),
            state=state,
            limits=CodecLimits(
                max_payload_bytes=MAX_EVENT_BYTES.read(env),
                max_clock_skew_ms=MAX_CLOCK_SKEW_MS.read(env),
            ),
            covisit=CoVisitConfig(
                window=COVISIT_WINDOW.read(env),
                window_ms=COVISIT_WINDOW_MS.read(env),
                max_pairs=COVISIT_MAX_PAIRS.read(env),
                users=COVISIT_USERS.read(env),
                candidates=candidates,
                neighbours=COVISIT_NEIGHBOURS.read(env),
                sequel_steps=SEQUEL_STEPS.read(env),
                sequel_successors=SEQUEL_SUCCESSORS.read(env),
            ),
            dead_letters=dead_letter_limits(env),
        )


def _validate_where(raw: str) -> bool:
    where = raw.strip()
    if where not in ("process", "thread"):
        raise ValueError("must be 'process' or 'thread'")
    return where == "process"
