"""Offline training (`inference/training/train.py`) and `freshrec run`'s reuse of trained models."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from freshrec.app.training import ensure_models, train_on_world, world_log
from freshrec.progress import ProgressLine
from freshrec.sim.world import World, WorldConfig
from inference.models.modelfile import read_manifest
from inference.training.train import TrainConfig, fit_ranker

SMALL = WorldConfig(seed=3, n_users=400, n_items=120, n_categories=6)


def test_ranking_models_stop_on_validation_loss_and_keep_their_best_epoch():
    """A model that can only overfit (pure noise labels): the validation loss is best early,
    training stops ``rank_patience`` epochs after it, and the weights of that epoch are kept."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    n, d = 512, 40
    x, x_valid = torch.randn(n, d), torch.randn(256, d)
    y, y_valid = ((rng.random(k) < 0.5).astype(np.float32) for k in (n, 256))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(d, 1)

        def forward(self, t):
            return self.linear(t).squeeze(-1)

    model = Model()
    cfg = TrainConfig(batch=64, rank_epochs=50, rank_patience=2)
    fit = fit_ranker(
        model,
        ((x,), y, np.ones(n, np.float32), None),
        ((x_valid,), y_valid, np.ones(256, np.float32), None),
        cfg,
        rng,
        lambda s: None,
        "noise",
    )
    with torch.inference_mode():
        kept = float(
            torch.nn.functional.binary_cross_entropy_with_logits(
                model(x_valid), torch.from_numpy(y_valid)
            )
        )
    assert fit["epochs"] == fit["best_epoch"] + cfg.rank_patience < cfg.rank_epochs
    assert abs(kept - fit["validation_loss"]) < 1e-4  # the best epoch's weights, not the last


def test_models_are_reused_for_the_same_world_and_configuration_only(tmp_path, caplog):
    world = World(SMALL)
    progress = ProgressLine()
    caplog.set_level(logging.INFO, logger="freshrec")
    first = ensure_models(world, tmp_path, TrainConfig(impressions=3000), progress)
    assert first["training"]["config"]["impressions"] == 3000
    again = ensure_models(world, tmp_path, TrainConfig(impressions=3000), progress)
    assert again["version"] == first["version"]
    # another configuration (here the impressions; likewise an older release's defaults)
    second = ensure_models(world, tmp_path, TrainConfig(impressions=4000), progress)
    assert second["version"] != first["version"]
    assert "with another training configuration" in caplog.text
    # another world
    third = ensure_models(
        World(replace(SMALL, seed=4)), tmp_path, TrainConfig(impressions=4000), progress
    )
    assert third["source"] != second["source"]
    assert read_manifest(tmp_path)["version"] == third["version"]


def test_the_tower_and_the_rankers_can_learn_from_disjoint_shares_of_the_logs(tmp_path):
    world = World(SMALL)
    cfg = TrainConfig(impressions=3000, dim=8, tower_epochs=1, rank_epochs=2)
    manifest = train_on_world(world, cfg, tmp_path / "both", lambda s: None)
    both = manifest["training"]
    assert both["tower_impressions"] == both["ranking_impressions"]  # the whole training split
    # every ranking model by default, each with its held-out AUC
    rankers = {"wide_deep", "light", "pruned", "attention", "attention_window", "attention_lowrank"}
    assert set(manifest["files"]) == {*rankers, "two_tower"}
    assert all(0 <= both[f"auc_{k}"] <= 1 for k in (*rankers, "tiered"))
    assert 0 < both["pruned_sparsity"] < 1
    split = train_on_world(
        world, replace(cfg, tower_share=0.5, rankers="pruned"), tmp_path / "split", lambda s: None
    )
    assert set(split["files"]) == {"wide_deep", "light", "pruned", "two_tower"}
    t = split["training"]
    assert t["tower_impressions"] + t["ranking_impressions"] == both["tower_impressions"]
    assert 0.4 < t["tower_impressions"] / both["tower_impressions"] < 0.6
    assert t["config"]["tower_share"] == 0.5
    with pytest.raises(ValueError, match="tower_share"):
        replace(cfg, tower_share=0.0)


def test_a_logistic_fine_tune_starts_from_the_softmax_rows_and_fits_the_impressions():
    """``softmax+logistic``: the softmax rows, then the logistic loss over every impression
    (those not clicked are negatives) from them: the impressions' log loss falls below the
    softmax rows' own."""
    from inference.training.twotower import train_two_tower

    world = World(SMALL)
    logs = world_log(world, 20_000, np.random.default_rng(4))
    idx = np.arange(len(logs.items))
    base = TrainConfig(impressions=20_000, dim=8, tower_epochs=4, finetune_epochs=3)

    def log_loss(cfg: TrainConfig) -> float:
        users, u, v = train_two_tower(logs, cfg, idx, lambda s: None)
        row = np.searchsorted(users, logs.users)
        logit = (u[row, :8] * v[logs.items, :8]).sum(1) + v[logs.items, 8]
        y = logs.clicked.astype(np.float64)
        p = 1 / (1 + np.exp(-logit.astype(np.float64)))
        return float(-(y * np.log(p + 1e-9) + (1 - y) * np.log(1 - p + 1e-9)).mean())

    softmax = log_loss(replace(base, tower_loss="softmax"))
    tuned = log_loss(replace(base, tower_loss="softmax+logistic"))
    assert tuned < softmax
    with pytest.raises(ValueError, match="tower_loss"):
        replace(base, tower_loss="bpr")


def test_the_softmax_tower_stops_on_validation_hits_and_keeps_its_best_epoch():
    """``tower_patience``: HR@10 on the validation rows after each epoch; training stops
    ``patience`` epochs after the best, and the rows returned are the best epoch's."""
    import re

    from inference.training.twotower import top_k_hits, train_two_tower

    world = World(SMALL)
    logs = world_log(world, 20_000, np.random.default_rng(5))
    n = len(logs.items)
    train_idx, valid_idx = np.arange(int(n * 0.8)), np.arange(int(n * 0.8), n)
    cfg = TrainConfig(
        impressions=20_000, dim=8, tower_loss="softmax", tower_epochs=25, tower_patience=2
    )
    said: list[str] = []
    users, u, v = train_two_tower(logs, cfg, train_idx, said.append, valid_idx)
    hrs = [float(x) for x in re.findall(r"validation HR@10 ([0-9.]+)", "\n".join(said))]
    assert hrs, said
    best = int(np.argmax(hrs))
    assert len(hrs) == cfg.tower_epochs or len(hrs) == best + 1 + cfg.tower_patience
    assert all(h <= hrs[best] for h in hrs[best + 1 :])
    kept = top_k_hits(
        logs, valid_idx, train_idx, np.searchsorted(users, logs.users), u, v, sample=5000
    )
    assert kept == pytest.approx(hrs[best], abs=1e-4)
    with pytest.raises(ValueError, match="tower_patience"):
        replace(cfg, tower_patience=-1)
