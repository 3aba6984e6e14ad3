"""The worker's serving settings, each declared once (``freshcore/declare.py``): the fields of
``ServingSettings``, the recall channels' (their quotas and deadlines are each channel's own
``default``, ``channels.py``), the degradation ladder's and the batching policy's. Those a
serving mode may set say so (``modes=True``); ``modes.py`` takes its keys from here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from freshcore.declare import Setting, SettingsError, declared, mode_settings, read_settings
from inference.models.kinds import served_rankers
from inference.models.tiers import HeatSplit
from inference.serving.breaker import BreakerConfig
from inference.serving.channels import default_channels, parse_delays, parse_quotas
from inference.serving.degrade import LadderConfig
from inference.serving.recall import ChannelConfig

SERVED_RANKERS = served_rankers()
"""What ``FRESHREC_RANKER`` accepts (``inference/models/kinds.py``)."""


def _channel_names(raw: str) -> tuple[str, ...]:
    wanted = tuple(c.strip() for c in raw.split(",") if c.strip())
    unknown = [c for c in wanted if c not in default_channels()]
    if unknown:
        raise ValueError(f"unknown channel(s) {unknown}")
    return wanted


RECALL_CHANNELS = Setting(
    "FRESHREC_RECALL_CHANNELS",
    None,
    "The recall channels that run, comma-separated (`inference/serving/channels.py`).",
    parse=_channel_names,
    shown="all: " + ", ".join(default_channels()),
)
RECALL_DEADLINE_SCALE = Setting(
    "FRESHREC_RECALL_DEADLINE_SCALE",
    1.0,
    "Multiplies every recall channel's deadline.",
    kind=float,
    positive=True,
    modes=True,
)
RECALL_QUOTAS = Setting(
    "FRESHREC_RECALL_QUOTAS",
    None,
    "Candidates per recall channel, `channel=count,…` (e.g. `new=120,hot=120`).",
    parse=parse_quotas,
    modes=True,
    shown="each channel's own",
)
RECALL_INJECT_DELAY_MS = Setting(
    "FRESHREC_RECALL_INJECT_DELAY_MS",
    None,
    "Fault injection for drills and tests: extra latency per channel, `channel=ms,…`.",
    parse=parse_delays,
)
QUEUE_DEPTH_LIMIT = Setting(
    "FRESHREC_QUEUE_DEPTH_LIMIT",
    LadderConfig.queue_depth_limit,
    "More requests than this waiting sends requests down the ladder (cached result, light model).",
    kind=int,
    minimum=1,
    modes=True,
)
COLD_HISTORY = Setting(
    "FRESHREC_COLD_HISTORY",
    LadderConfig.cold_history,
    "A user with fewer known interactions than this is served the hot list, by design (0: "
    "nobody): what works for users the models know nothing about.",
    kind=int,
    minimum=0,
    modes=True,
)
TIER_HEAD_SHARE = Setting(
    "FRESHREC_TIER_HEAD_SHARE",
    HeatSplit.head_share,
    "The `tiered` ranker: the warm catalogue's hottest share, ranked by Wide&Deep.",
    kind=float,
    minimum=0,
    maximum=1,
)
TIER_MID_SHARE = Setting(
    "FRESHREC_TIER_MID_SHARE",
    HeatSplit.mid_share,
    "The `tiered` ranker: the next share, ranked by the pruned model (the rest by the light).",
    kind=float,
    minimum=0,
    maximum=1,
)
MAX_BATCH = Setting(
    "FRESHREC_MAX_BATCH",
    32,
    "Dynamic batching: the most requests served in one batch.",
    kind=int,
    minimum=1,
    modes=True,
)
MAX_WAIT_MS = Setting(
    "FRESHREC_MAX_WAIT_MS",
    0,
    "Dynamic batching: how long the oldest queued request may wait for more.",
    kind=int,
    minimum=0,
    modes=True,
)
BREAKER_THRESHOLD = Setting(
    "FRESHREC_BREAKER_THRESHOLD",
    BreakerConfig.threshold,
    "A recall channel's breaker opens above this timeout rate over its last calls.",
    kind=float,
    positive=True,
    maximum=1,
)
BREAKER_COOLDOWN_MS = Setting(
    "FRESHREC_BREAKER_COOLDOWN_MS",
    BreakerConfig.cooldown_ms,
    "How long an open breaker waits before it lets a probe through.",
    kind=int,
    minimum=1,
)


@dataclass(frozen=True)
class ServingSettings:
    candidates: int = declared(
        "FRESHREC_CANDIDATES", 500, "Candidates after recall's merge.", minimum=1, modes=True
    )
    default_budget_ms: int = declared(
        "FRESHREC_REQUEST_BUDGET_MS",
        250,
        "The serving budget from when a request was produced (its record's timestamp), or its "
        "`deadline_ms` if earlier: what the tiers plan to.",
        minimum=1,
        modes=True,
    )
    """Deadline budget of a request that names none."""
    mmr_lambda: float = declared(
        "FRESHREC_MMR_LAMBDA",
        0.7,
        "MMR's weight of relevance against similarity (1: relevance alone).",
        minimum=0,
        maximum=1,
        modes=True,
    )
    category_gap: int = declared(
        "FRESHREC_CATEGORY_GAP",
        2,
        "No two items of one category closer than this in a list, where avoidable.",
        minimum=1,
        modes=True,
    )
    hold_shown_s: float = declared(
        "FRESHREC_HOLD_SHOWN_S",
        0.0,
        "Items a user was shown are left out of that user's lists for this long, so a "
        "refresh shows something new (0: not held back).",
        minimum=0,
        modes=True,
    )
    """``inference/tables/shown.py``."""
    hold_shown_users: int = 20_000
    """Users whose shown items are remembered (the most recently served)."""
    channels: dict[str, ChannelConfig] = field(default_factory=default_channels)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    result_ttl_ms: int = declared(
        "FRESHREC_RESULT_TTL_MS", 3_600_000, "How long a cached result may be served.", minimum=1
    )
    result_cache_entries: int = 100_000
    mmr_pool_factor: int = 10
    """MMR re-ranks the best ``factor × k`` candidates (diversity among the relevant ones)."""
    ann_min_items: int = declared(
        "FRESHREC_ANN_MIN_ITEMS",
        200_000,
        "Catalogues at least this large use the IVF index for the vector channel on a CPU.",
        minimum=1,
    )
    """Smaller ones, and every catalogue on an accelerator, are searched exactly."""
    ann_nprobe: int = declared(
        "FRESHREC_ANN_NPROBE",
        0,
        "Cells an IVF query probes (0: 4% of the catalogue, at least 64 cells).",
        minimum=0,
    )
    ann_refresh_s: float = declared(
        "FRESHREC_ANN_REFRESH_S", 300.0, "How often the IVF index is rebuilt.", positive=True
    )
    recall_share: float = 0.5
    """At most this share of the tightest budget in a batch is spent waiting for recall."""
    ranker: str = declared(
        "FRESHREC_RANKER",
        "wide_deep",
        "The full tier's ranking model.",
        choices=SERVED_RANKERS,
        modes=True,
    )
    """``inference/serving/rankstage.py``; a variant's ``ranking`` overrides it for its
    users."""
    heat_split: HeatSplit = field(default_factory=HeatSplit)
    """The ``tiered`` ranker's head and middle shares of the warm catalogue by heat."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ServingSettings:
        return read_settings(
            cls,
            env,
            channels=recall_channels(env),
            ladder=LadderConfig(
                queue_depth_limit=QUEUE_DEPTH_LIMIT.read(env), cold_history=COLD_HISTORY.read(env)
            ),
            heat_split=heat_split(env),
        )


MODE_SETTINGS = mode_settings(ServingSettings) | {
    s.env
    for s in (
        RECALL_DEADLINE_SCALE,
        RECALL_QUOTAS,
        QUEUE_DEPTH_LIMIT,
        COLD_HISTORY,
        MAX_BATCH,
        MAX_WAIT_MS,
    )
}
"""What a serving mode may set: the worker applies each of them to the next batch it serves."""


def recall_channels(env: Mapping[str, str]) -> dict[str, ChannelConfig]:
    """The channels that run, each deadline scaled, each quota its own or the setting's."""
    channels = default_channels()
    wanted = RECALL_CHANNELS.read(env)
    if wanted:
        channels = {c: channels[c] for c in wanted}
    scale = RECALL_DEADLINE_SCALE.read(env)
    quotas = RECALL_QUOTAS.read(env) or {}
    return {
        k: replace(v, deadline_ms=v.deadline_ms * scale, quota=quotas.get(k, v.quota))
        for k, v in channels.items()
    }


def heat_split(env: Mapping[str, str]) -> HeatSplit:
    """The ``tiered`` ranker's shares of the warm catalogue by heat."""
    try:
        return HeatSplit(TIER_HEAD_SHARE.read(env), TIER_MID_SHARE.read(env))
    except ValueError as exc:
        raise SettingsError(f"FRESHREC_TIER_HEAD_SHARE/FRESHREC_TIER_MID_SHARE: {exc}") from None


def breaker(env: Mapping[str, str]) -> BreakerConfig:
    return BreakerConfig(
        threshold=BREAKER_THRESHOLD.read(env), cooldown_ms=BREAKER_COOLDOWN_MS.read(env)
    )
