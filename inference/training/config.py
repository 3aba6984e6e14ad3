"""What ``freshrec train`` is told: the settings of one offline training (``TrainConfig``),
checked when they are made.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.models.attention import SEQUENCE
from inference.models.features import DENSE
from inference.training.rankers import RANKERS, parse_rankers


@dataclass(frozen=True)
class TrainConfig:
    impressions: int = 1_000_000
    dim: int = 64
    tower_epochs: int = 3
    tower_patience: int = 0
    """0: the two-tower trains ``tower_epochs`` epochs. Above 0 (the softmax two-tower):
    ``tower_epochs`` is a maximum; after each epoch the rows' HR@10 on the validation rows
    (``top_k_hits``) is measured, training stops once it has not improved for this many
    epochs, and the best epoch's rows are kept — the number of passes chosen on the training
    part, never on what a replay scores."""
    rank_epochs: int = 40
    """At most; each ranking model stops earlier once its validation loss has not improved for
    ``rank_patience`` epochs, and keeps its best epoch. (A fixed two epochs left the models
    undertrained: 36 Adam steps on the tests' 40k impressions, where the light model's held-out
    AUC was 0.43, and the recent-click feature weighed a quarter of what the logs support.)"""
    rank_patience: int = 3
    batch: int = 2048
    seed: int = 11
    conversion_weight: float = 3.0
    tower_lr: float = 0.1
    l2: float = 2.0
    """Per-example L2 on the rows a batch touches: most items are seen a few times in the logs,
    and weaker penalties let their rows memorise those labels (train AUC 0.99, test 0.58)."""
    tower_share: float = 1.0
    """Share of the training logs the two-tower model learns from; the ranking models learn
    from the rest (from all of them at 1.0). Below 1.0 the rankers see the tower's scores on
    impressions it did not fit, as serving does."""
    tower_loss: str = "logistic"
    """``logistic`` over labelled impressions (the synthetic world's logs), or ``softmax``
    over the clicked items of a batch and ``softmax_negatives`` items drawn uniformly from
    the catalogue (positive-only logs, ``freshrec train --log``; ``inference/learning/steps.py``
    says why), or ``softmax+logistic``: softmax first, then ``finetune_epochs`` of the
    logistic loss over every impression from those rows (impressions not clicked are
    negatives: what online learning on impressions learns)."""
    finetune_epochs: int = 2
    finetune_lr: float = 0.02
    """Adagrad's step size for the logistic fine-tune of ``softmax+logistic``."""
    softmax_negatives: int = 50
    softmax_l2: float = 1e-4
    softmax_lr: float = 0.01
    """Adam's step size for the softmax two-tower."""
    features: str = ",".join(DENSE)
    """The ranking models' dense inputs: models trained with others are trained again."""
    rankers: str = ",".join(RANKERS)
    """The further ranking models (``inference/training/rankers.py``): the pruned tier and the
    attention rankers; Wide&Deep and the light model always train."""
    prune_keep: float = 0.5
    """The share of each hidden layer's units the pruned model keeps."""
    sequence: int = SEQUENCE
    """Items of a user's history the attention rankers read."""
    cold_item_start: bool = True
    """Catalogue items with no positive interaction in the two-tower's part start from their
    category's mean learnt row (``inference/models/coldstart.py``) instead of a row that
    only sampled negatives moved."""

    def __post_init__(self) -> None:
        if min(self.impressions, self.dim, self.tower_epochs, self.rank_epochs, self.batch) < 1:
            raise ValueError("impressions, dim, epochs and batch must be at least 1")
        if not self.l2 >= 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")
        if not 0 < self.tower_share <= 1:
            raise ValueError(f"tower_share must be in (0, 1], got {self.tower_share}")
        if self.tower_loss not in TOWER_LOSSES:
            raise ValueError(f"tower_loss must be one of {TOWER_LOSSES}, got {self.tower_loss!r}")
        parse_rankers(self.rankers)
        if not 0 < self.prune_keep < 1:
            raise ValueError(f"prune_keep must be in (0, 1), got {self.prune_keep}")
        if self.sequence < 1:
            raise ValueError(f"sequence must be at least 1, got {self.sequence}")
        if self.tower_patience < 0:
            raise ValueError(f"tower_patience must be at least 0, got {self.tower_patience}")


TOWER_LOSSES = ("logistic", "softmax", "softmax+logistic")
