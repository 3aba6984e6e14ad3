"""Conformance of every registry: an entry passes these checks just by being registered.

- ranking models (``inference/models/kinds.py`` ``KINDS``): built, saved, reloaded through the
  model files, scoring a batch (grouped and not) with probabilities, trained by
  ``freshrec train`` (always, or by a ``TRAINERS`` line when named), and accepted wherever a
  user can name a ranker (``FRESHREC_RANKER``, ``--rankers``, an experiment's ``ranking``);
- recall channels (``inference/serving/channels.py`` ``CHANNELS``): a name, a default quota and
  deadline, slots of catalogue items only, one list per query, and accepted by
  ``FRESHREC_RECALL_CHANNELS``, injected delays and an experiment's ``recall_quotas``;
- replay baselines (``evaluation/baselines.py`` ``BASELINES``): every setting of the grid the
  replay searches learns a log and recommends distinct items it has seen, none excluded, and
  ``freshrec replay --baselines`` names every one.

The lists a user can name are the registries' (a second copy would drift).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation.baselines import BASELINES as BASELINE_SPECS
from inference.models import kinds
from inference.models.modelfile import load_model, save_model
from inference.models.ranking import score
from inference.serving import channels as ch
from inference.serving.experiments import CHANNELS as EXPERIMENT_CHANNELS
from inference.serving.experiments import RANKINGS, ExperimentError, parse
from inference.serving.recall import Recalled
from inference.settings import SERVED_RANKERS, served_ranker
from inference.training import rankers
from inference.training.train import TrainConfig
from tests.test_rankers_unit import D, _pairs

CPU = torch.device("cpu")


def _experiment(variant: str):
    """An experiments file whose treatment variant says ``variant`` (TOML lines)."""
    return parse(
        '[experiment]\nname = "e"\n[[variant]]\nname = "control"\nshare = 0.5\n'
        f'[[variant]]\nname = "treatment"\nshare = 0.5\n{variant}\n'
    )


# ------------------------------------------------------------------------- ranking models
@pytest.mark.parametrize("name", list(kinds.KINDS))
def test_every_ranker_builds_saves_reloads_and_scores(name, tmp_path):
    model = kinds.build(name, D)
    assert model.kind == name
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    entry = save_model(tmp_path, model.eval(), "v1", D)
    again = load_model(tmp_path, {"version": "v1", "dim": D, "files": {name: entry}}, name, CPU)
    for x in (_pairs(12), _pairs(12, requests=3)):
        if getattr(model, "uses_sequence", False):
            rng = np.random.default_rng(2)
            rows = len(x.user) if x.owner is not None else len(x)
            seq = torch.from_numpy(
                rng.standard_normal((rows, model.length, D + 1)).astype(np.float32)
            )
            x = x.with_sequences(seq, torch.full((rows,), model.length // 2))
        a, b = score(model.eval(), x, CPU), score(again, x, CPU)
        assert a.shape == (12,) and np.all(np.isfinite(a) & (a >= 0) & (a <= 1))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(kinds.KINDS))
def test_every_ranker_trained_before_a_feature_existed_serves_without_it(name, tmp_path):
    """A model file of a release that computed fewer ranking features (its files named none:
    its manifest's training configuration says which) serves with its own, in its order,
    exactly as it scored before; a file naming a feature this release does not compute, or
    one that says nothing of its features, is refused with the reason."""
    from inference.models.features import DENSE
    from inference.models.modelfile import ModelFileError, model_features, save_tensors

    older = DENSE[:-1]  # the features before the newest
    model = kinds.build(name, D, features=older)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    state = model.eval().state_dict()
    entry = save_tensors(tmp_path, "old.safetensors", state, {"kind": name, "dim": D})
    manifest = {"version": "old", "dim": D, "files": {name: entry}}
    with pytest.raises(ModelFileError, match="trained with: run `freshrec train`"):
        load_model(tmp_path, manifest, name, CPU)
    trained = {**manifest, "training": {"config": {"features": ",".join(older)}}}
    again = load_model(tmp_path, trained, name, CPU)
    assert again.features == older
    x = _pairs(12, requests=3)
    if getattr(model, "uses_sequence", False):
        seq = torch.ones((len(x.user), model.length, D + 1))
        x = x.with_sequences(seq, torch.full((len(x.user),), model.length // 2))
    mine = x.with_dense(np.arange(len(older)))  # what it was trained on: no newest column
    np.testing.assert_allclose(score(again, x, CPU), score(model, mine, CPU), rtol=1e-5)
    newer = {**manifest, "features": [*DENSE, "novelty"]}
    with pytest.raises(ModelFileError, match=r"does not compute \(novelty\)"):
        model_features(tmp_path, newer, entry)


@pytest.mark.parametrize("name", list(kinds.KINDS))
def test_every_ranker_is_trained_and_can_be_named(name):
    kind = kinds.KINDS[name]
    if kind.always_trained:
        assert name not in rankers.RANKERS
    else:
        assert name in rankers.TRAINERS, (
            f"{name}: no line in inference/training/rankers.py TRAINERS"
        )
        assert rankers.parse_rankers(name) == (name,)
        assert name in TrainConfig().rankers.split(","), "train's default trains every ranker"
    assert name in RANKINGS
    assert _experiment(f'ranking = "{name}"').variants[1].ranking == name
    if kind.served:
        assert served_ranker({"FRESHREC_RANKER": name}) == name
    else:
        with pytest.raises(ValueError):
            served_ranker({"FRESHREC_RANKER": name})


def test_the_lists_a_user_names_are_the_registry():
    assert set(SERVED_RANKERS) == {k for k, v in kinds.KINDS.items() if v.served} | {kinds.TIERED}
    assert set(RANKINGS) == {*kinds.KINDS, kinds.TIERED, kinds.FULL_ALIAS}
    assert set(rankers.TRAINERS) == set(rankers.RANKERS)
    assert kinds.TIER_MODELS == ("wide_deep", "pruned", "light")
    assert set(EXPERIMENT_CHANNELS) == set(ch.CHANNELS)
    with pytest.raises(ExperimentError, match="ranking must be one of"):
        _experiment('ranking = "nope"')


# --------------------------------------------------------------------------- recall channels
@pytest.mark.parametrize("name", list(ch.CHANNELS))
def test_every_channel_answers_a_batch_with_catalogue_slots(name, monkeypatch):
    from tests.serving_harness import serving_state  # a worker's state over a small catalogue

    cls = ch.CHANNELS[name]
    assert cls.name == name and cls.default.quota > 0 and cls.default.deadline_ms > 0
    state, queries = serving_state()
    lists = ch.make_channels({name: cls.default}, state)[name].recall(queries, 20)
    if isinstance(lists, Recalled):  # what it read on the way names only the batch's users
        assert set(lists.recent) <= {q.user_id for q in queries}
        lists = lists.slots
    assert len(lists) == len(queries)
    named = state.named.cpu().numpy()
    for slots in lists:
        slots = np.asarray(slots)
        assert slots.dtype == np.int64 and len(slots) <= 20
        assert named[slots].all(), f"{name} recalled items outside the catalogue"
        assert len(set(slots.tolist())) == len(slots)


@pytest.mark.parametrize("name", list(ch.CHANNELS))
def test_every_channel_can_be_chosen_delayed_and_given_a_quota(name):
    from inference.settings import WorkerSettings

    s = WorkerSettings.from_env(
        {"FRESHREC_RECALL_CHANNELS": name, "FRESHREC_RECALL_INJECT_DELAY_MS": f"{name}=5"}
    )
    assert list(s.serving.channels) == [name]
    assert s.recall_delays_ms == {name: 5.0}
    exp = _experiment(f"[variant.recall_quotas]\n{name} = 3")
    assert exp.variants[1].recall_quotas == {name: 3}


# ------------------------------------------------------------------------ replay baselines
@pytest.mark.parametrize("name", list(BASELINE_SPECS))
def test_every_baseline_learns_and_recommends_what_it_has_seen_and_not_excluded(name):
    spec = BASELINE_SPECS[name]
    assert spec.name == name
    rng = np.random.default_rng(0)
    users = [f"u{x}" for x in rng.integers(0, 30, 600)]
    items = [f"i{x}" for x in rng.zipf(1.5, 600) % 50]
    grid = spec.candidates(len(users))
    assert grid and len({label for label, _ in grid}) == len(grid)
    for label, settings in grid:
        model = spec.cls(**settings)
        model.learn(users[:300], items[:300])
        model.learn(users[300:], items[300:])
        seen = set(items)
        for user in ("u1", "u7", "stranger"):
            exclude = set(items[:5])
            got = model.recommend(user, 10, exclude)
            assert len(got) <= 10 and len(set(got)) == len(got), label
            assert not set(got) & exclude and set(got) <= seen, label
        assert model.recommend("u1", 10, set()), f"{name} {label} recommends nothing"


def test_the_replay_names_every_registered_baseline():
    from freshrec.app.replay import BASELINES

    assert set(BASELINES) == set(BASELINE_SPECS)
