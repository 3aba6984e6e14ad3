"""What an experiment's variant changes in serving one request. Pure.

An ``Arm`` is the experiment and variant a request's user is assigned to. Serving applies it
at four points: the request (``exclude_seen`` where the request does not say), recall (each
channel's quota lowered to the variant's), the ranking tier (the variant's model where the
ladder chose the full one — a ladder that steps down, for a device, a deadline or a
failure, still wins), and MMR (the variant's λ).

>>> from inference.serving.experiments import Variant
>>> arm = Arm("e1", Variant("light", 0.5, ranking="light", mmr_lambda=0.3, recall_quotas={"hot": 5}))
>>> steer(Choice("full", "ok"), arm)
Choice(tier='light', reason='ok; experiment e1: variant light')
>>> steer(Choice("hot", "no models"), arm).tier  # degradation wins
'hot'
>>> tiered = Arm("e1", Variant("tiered", 0.5, ranking="tiered"))
>>> choice = steer(Choice("full", "ok"), tiered)
>>> choice.tier, ranker_of(choice, tiered, "wide_deep"), ranker_of(choice, None, "wide_deep")
('full', 'tiered', 'wide_deep')
>>> quotas({"hot": 50, "vector": 200}, arm)
{'hot': 5, 'vector': 200}
>>> lambdas([arm, None], 0.7)
[0.3, 0.7]
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from inference.models.kinds import FULL_ALIAS
from inference.serving.degrade import FULL, LIGHT, Choice
from inference.serving.experiments import Variant
from schemas.records import RecommendRequest


@dataclass(frozen=True)
class Arm:
    experiment: str
    variant: Variant


def request(req: RecommendRequest, arm: Arm | None) -> RecommendRequest:
    """The request with the variant's ``exclude_seen`` where it does not say itself."""
    if arm is None or arm.variant.exclude_seen is None or req.exclude_seen is not None:
        return req
    return replace(req, exclude_seen=arm.variant.exclude_seen)


def quotas(default: dict[str, int], arm: Arm | None) -> dict[str, int]:
    """Each recall channel's quota: the worker's, lowered to the variant's."""
    if arm is None or not arm.variant.recall_quotas:
        return default
    mine = arm.variant.recall_quotas
    return {name: min(q, mine.get(name, q)) for name, q in default.items()}


def steer(choice: Choice, arm: Arm | None) -> Choice:
    """The ladder's choice with the variant's ranking where the ladder chose the full tier
    (any step down — light, cached, hot — is the ladder's to make, and stays): the light
    tier for ``light``; the full tier, its model named, for the others (``ranker_of``)."""
    if arm is None or arm.variant.ranking is None or choice.tier != FULL:
        return choice
    note = f"experiment {arm.experiment}: variant {arm.variant.name}"
    tier = LIGHT if arm.variant.ranking == LIGHT else FULL
    return Choice(tier, f"{choice.reason}; {note}")


def ranker_of(choice: Choice, arm: Arm | None, default: str) -> str | None:
    """The model that ranks a request's candidates: ``light`` on the light tier; on the full
    tier the variant's (``full`` is Wide&Deep), else the worker's ``default``; None on the
    tiers no model ranks (cached, hot)."""
    if choice.tier == LIGHT:
        return LIGHT
    if choice.tier != FULL:
        return None
    mine = arm.variant.ranking if arm is not None else None
    if mine is None:
        return default
    return "wide_deep" if mine == FULL_ALIAS else mine


def lambdas(arms: list[Arm | None], default: float) -> list[float]:
    """MMR's λ per request: the variant's, else the worker's."""
    return [
        default if a is None or a.variant.mmr_lambda is None else a.variant.mmr_lambda for a in arms
    ]


def reply_fields(arm: Arm | None) -> dict[str, str | None]:
    """The reply's ``experiment`` and ``variant``."""
    if arm is None:
        return {"experiment": None, "variant": None}
    return {"experiment": arm.experiment, "variant": arm.variant.name}
