"""The attention rankers, the pruned tier and routing by item heat: shapes, masking, the
grouped form against the expanded one, train/serve sequence equality, pruning against the
masked full model, and which model scores which candidate of a tiered request."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inference.models.attention import (
    ATTENTION_KINDS,
    AttentionRanker,
    gather_sequences,
    sequence_index,
)
from inference.models.features import FeatureEncoder, RankInputs
from inference.models.modelfile import ModelSet, build
from inference.models.prune import masked, prune, sparsity
from inference.models.ranking import LightRanker, WideDeep, as_tensors, score
from inference.models.tiers import HEAD, MIDDLE, TAIL, HeatSplit, route, thresholds
from inference.serving.arms import Arm, ranker_of, steer
from inference.serving.degrade import Choice
from inference.serving.experiments import ExperimentError, Variant, parse
from inference.serving.rankstage import RankBatch, RankingStage
from inference.tables.recent import RecentClicks
from inference.training.rankers import parse_rankers

D = 8
CPU = torch.device("cpu")


def _pairs(n: int, seed: int = 0, requests: int | None = None) -> RankInputs:
    """``n`` random pairs (grouped over ``requests`` when given)."""
    rng = np.random.default_rng(seed)
    owner = None
    users = n
    if requests is not None:
        owner = np.sort(rng.integers(0, requests, n))
        owner[:requests] = np.arange(requests)  # every request has a pair
        owner.sort()
        users = requests
    ctx = FeatureEncoder().context(["pc"] * n, ["north"] * n, [1_767_225_600_000] * n)
    return FeatureEncoder().encode(
        rng.standard_normal((users, D + 1)).astype(np.float32),
        rng.standard_normal((n, D + 1)).astype(np.float32),
        rng.random((n, 4)).astype(np.float32),
        rng.integers(0, 128, n),
        ctx,
        rng.random(n).astype(np.float32),
        owner=owner,
        recent_similarity=rng.standard_normal(n).astype(np.float32),
    )


def _sequences(rows: int, length: int, lens, seed: int = 1):
    rng = np.random.default_rng(seed)
    seq = torch.from_numpy(rng.standard_normal((rows, length, D + 1)).astype(np.float32))
    return seq, torch.as_tensor(lens)


def _trained_like(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Weights away from their initial values (zero position weights, zero wide crosses
    would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_attention_ranker_shapes_and_grouped_form_equal_the_expanded_one(kind):
    model = _trained_like(AttentionRanker(D, kind, length=12, window=4, rank=3))
    x = _pairs(30, requests=5)
    seq, lens = _sequences(5, 12, [12, 0, 3, 7, 1])
    grouped = score(model, x.with_sequences(seq, lens), CPU)
    expanded = score(model, x.with_sequences(seq, lens).expanded(), CPU)
    assert grouped.shape == (30,) and np.isfinite(grouped).all()
    np.testing.assert_allclose(grouped, expanded, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_padding_is_masked_whatever_it_holds(kind):
    model = _trained_like(AttentionRanker(D, kind, length=12, window=4, rank=3))
    x = _pairs(10)
    seq, lens = _sequences(10, 12, [5, 0, 12, 2, 1, 3, 9, 4, 11, 6])
    noisy = seq.clone()
    for r, n in enumerate(lens.tolist()):
        noisy[r, n:] = 1e3 * torch.randn(12 - n, D + 1)
    a = score(model, x.with_sequences(seq, lens), CPU)
    b = score(model, x.with_sequences(noisy, lens), CPU)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # no history: the interest is zero, as for a sequence of zero rows
    empty = model.interest(torch.from_numpy(x.item), seq, torch.zeros(10, dtype=torch.long))
    assert torch.count_nonzero(empty) == 0


def test_the_window_reads_the_newest_positions_only_and_short_sequences_are_not_padded_out():
    model = _trained_like(AttentionRanker(D, "attention_window", length=12, window=4))
    x = _pairs(6)
    seq, lens = _sequences(6, 12, [12] * 6)
    older = seq.clone()
    older[:, 4:] = torch.randn(6, 8, D + 1)
    a = score(model, x.with_sequences(seq, lens), CPU)
    np.testing.assert_array_equal(a, score(model, x.with_sequences(older, lens), CPU))
    changed = seq.clone()
    changed[:, 3] += 1.0  # the window's oldest position does count (on the logits: the
    # probabilities of random weights may saturate at 1)

    def logits(s: torch.Tensor) -> torch.Tensor:
        user, item, dense, sparse, cross = as_tensors(x, CPU)
        with torch.no_grad():
            return model(user, item, dense, sparse, cross, s, lens)

    assert not torch.allclose(logits(seq), logits(changed))
    # a sequence shorter than the model's length gives what its padded form gives
    short = score(model, x.with_sequences(seq[:, :3], torch.full((6,), 3)), CPU)
    padded = score(model, x.with_sequences(seq, torch.full((6,), 3)), CPU)
    np.testing.assert_allclose(short, padded, rtol=1e-5, atol=1e-6)


def test_attention_models_round_trip_through_their_files_shapes():
    for kind in ATTENTION_KINDS:
        model = AttentionRanker(D, kind, length=20, window=5, rank=4)
        again = build(kind, D, model.state_dict())
        again.load_state_dict(model.state_dict())
        assert (again.kind, again.span, again.positions) == (kind, model.span, model.positions)


def test_the_attention_ranker_needs_sequences():
    with pytest.raises(ValueError, match="sequences"):
        score(AttentionRanker(D), _pairs(3), CPU)


def test_training_and_serving_build_the_same_sequence():
    """The worker's per-user clicks (``RecentClicks``) and training's rebuild from a log
    (``recent_context``) give the same items in the same order, and the same encoder turns
    them into the same model input."""
    from inference.training.logfeatures import TrainingLog, recent_context

    # one user: clicks on 0, 1, 2, 1 (again), a conversion on 3, impressions of 4 never
    clicks = [(0, True), (4, False), (1, True), (2, True), (1, True), (3, True), (4, False)]
    n = len(clicks)
    logs = TrainingLog(
        user_ids=np.array(["u0"], object),
        item_ids=np.array([f"i{i}" for i in range(6)], object),
        item_category=np.array(["a"] * 6, object),
        item_price=np.zeros(6),
        users=np.zeros(n + 1, np.int64),
        items=np.array([i for i, _ in clicks] + [5]),
        t_ms=np.arange(n + 1),
        clicked=np.array([c for _, c in clicks] + [False]),
        converted=np.zeros(n + 1, bool),
        device=np.full(n + 1, -1),
        region=np.full(n + 1, None, object),
    )
    _, recent = recent_context(logs, np.zeros(6, np.int64), length=4)
    trained = recent[-1]  # the sequence when item 5 was shown, after every click
    served = RecentClicks(users=10, per_user=50)
    served.remember(
        SimpleNamespace(user_id="u0", item_id=f"i{i}", event_type="click" if c else "impression")
        for i, c in clicks
    )
    slot_of = {f"i{i}": i for i in range(6)}
    serve_index = sequence_index([[slot_of[x] for x in served.get("u0")]], len(trained))
    assert trained.tolist() == serve_index[0].tolist()
    assert trained[:5].tolist() == [3, 1, 2, 0, -1]
    table = torch.randn(6, D + 1)
    a = gather_sequences(lambda ix: table[ix], trained[None, :].astype(np.int64))
    b = gather_sequences(lambda ix: table.index_select(0, ix), serve_index, CPU)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------ pruning
def test_the_pruned_model_equals_the_full_model_where_its_weights_are_kept():
    full = _trained_like(WideDeep(D, hidden=(32, 16)))
    small = prune(full, 0.25)
    assert small.hidden == (8, 4) and small.kind == "pruned"
    assert 0.7 < sparsity(full, small) < 0.9
    x = _pairs(40)
    np.testing.assert_allclose(
        score(small, x, CPU), score(masked(full, 0.25), x, CPU), rtol=1e-5, atol=1e-6
    )
    # and pruning does change the model (the equality above is not trivial)
    assert not np.allclose(score(small, x, CPU), score(full, x, CPU), atol=1e-4)
    again = build("pruned", D, small.state_dict())
    again.load_state_dict(small.state_dict())
    np.testing.assert_array_equal(score(again, x, CPU), score(small, x, CPU))
    grouped = _pairs(40, requests=6)
    np.testing.assert_allclose(
        score(small, grouped, CPU), score(small, grouped.expanded(), CPU), rtol=1e-4, atol=1e-6
    )


def test_prune_keeps_units_by_importance():
    full = WideDeep(D, hidden=(4, 2))
    with torch.no_grad():
        for i, layer in enumerate(m for m in full.deep if isinstance(m, torch.nn.Linear)):
            layer.weight.fill_(0.01)
            if i == 0:
                layer.weight[2] = 1.0  # unit 2 reads a lot
    from inference.models.prune import kept_units

    assert kept_units(full, 0.25)[0].tolist() == [2]
    with pytest.raises(ValueError):
        prune(full, 0.0)


# ------------------------------------------------------------------------------- routing
def test_heat_thresholds_and_routes():
    hot = np.array([10.0, 8.0, 6.0, 4.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    cut = thresholds(hot, HeatSplit(0.2, 0.3))  # of the six warm items: 2 head, 1 middle
    assert cut == (8.0, 6.0)
    assert route(np.array([9.0, 8.0, 7.9, 6.0, 5.9, 0.0]), cut).tolist() == [
        HEAD,
        HEAD,
        MIDDLE,
        MIDDLE,
        TAIL,
        TAIL,
    ]
    # all cold: everything is tail, whatever the shares
    assert (route(np.zeros(4), thresholds(np.zeros(8), HeatSplit(0.5, 0.5))) == TAIL).all()
    assert thresholds(hot, HeatSplit(0.0, 0.0)) == (float("inf"), float("inf"))
    with pytest.raises(ValueError, match="at most 1"):
        HeatSplit(0.7, 0.4)


def _stage(split: HeatSplit, cls=RankingStage) -> RankingStage:
    """The ranking stage, without a worker."""
    settings = SimpleNamespace(heat_split=split, ranker="wide_deep")
    return cls(settings, SimpleNamespace(device=CPU), None, None)


def _heats(hot: np.ndarray) -> np.ndarray:
    """A features snapshot whose items have these hot scores."""
    return np.column_stack([hot * 0, hot * 0, hot])


def test_a_tiered_request_scores_each_candidate_with_its_heat_tiers_model():
    full = _trained_like(WideDeep(D, hidden=(16, 8)))
    models = ModelSet("v", full, _trained_like(LightRanker(D)), {"pruned": prune(full, 0.5)})
    catalogue_hot = np.arange(100, dtype=np.float64)  # 0 (cold) and 1..99 (warm)
    stage = _stage(HeatSplit(0.1, 0.3))  # head >= 90, middle >= 60
    features = _heats(catalogue_hot)
    x = _pairs(12, requests=3)
    dense = np.zeros((12, 4), np.float32)
    dense[:, 3] = [95, 5, 70, 0, 91, 61, 59, 99, 1, 65, 0, 90]
    got = stage._score_tiered(models, x, dense, [None, None, None], features).numpy()
    want = np.select(
        [dense[:, 3] >= 90, dense[:, 3] >= 60],
        [score(full, x, CPU), score(models.others["pruned"], x, CPU)],
        score(models.light, x, CPU),
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # a variant's split: everything warm is head
    arm = Arm("e", Variant("t", 1.0, ranking="tiered", head_share=1.0, mid_share=0.0))
    got = stage._score_tiered(models, x, dense, [arm] * 3, features).numpy()
    want = np.where(dense[:, 3] > 0, score(full, x, CPU), score(models.light, x, CPU))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ variants and settings
def test_variants_name_the_new_rankers_and_the_ladder_still_wins():
    exp = parse(
        '[experiment]\nname = "r"\n\n[[variant]]\nname = "a"\nshare = 0.5\nranking = "attention"\n'
        '\n[[variant]]\nname = "t"\nshare = 0.5\nranking = "tiered"\nhead_share = 0.2\n'
    )
    attention, tiered = (Arm("r", v) for v in exp.variants)
    assert tiered.variant.head_share == 0.2 and tiered.variant.mid_share is None
    ok = Choice("full", "ok")
    assert ranker_of(steer(ok, attention), attention, "wide_deep") == "attention"
    assert steer(ok, attention).tier == "full"
    assert ranker_of(steer(Choice("light", "low_end"), attention), attention, "x") == "light"
    assert ranker_of(steer(Choice("hot", "no models"), tiered), tiered, "x") is None
    control = Arm("r", Variant("c", 1.0, ranking="full"))
    assert ranker_of(ok, control, "attention") == "wide_deep"


def test_bad_ranking_settings_are_one_line_errors():
    bad = '[experiment]\nname = "r"\n\n[[variant]]\nname = "a"\nshare = 0.5\nhead_share = 0.2\n'
    bad += '\n[[variant]]\nname = "b"\nshare = 0.5\n'
    with pytest.raises(ExperimentError, match=r":7: variant 'a': head_share applies to"):
        parse(bad)
    with pytest.raises(ValueError, match="unknown rankers"):
        parse_rankers("pruned,transformer")
    from freshcore.settings import SettingsError
    from inference.settings import heat_split, served_ranker

    with pytest.raises(SettingsError, match="FRESHREC_RANKER"):
        served_ranker({"FRESHREC_RANKER": "deep"})
    assert served_ranker({}) == "wide_deep"
    with pytest.raises(SettingsError, match="at most 1"):
        heat_split({"FRESHREC_TIER_HEAD_SHARE": "0.8", "FRESHREC_TIER_MID_SHARE": "0.5"})


def test_a_ranker_the_models_lack_is_replaced_by_wide_deep_and_the_reply_says_so():
    class Stage(RankingStage):
        def _inputs(self, b, group, realtime_features):
            n = sum(len(b.merged[j]) for j in group)
            return _pairs(n), None, np.zeros((n, 4), np.float32)

    stage = _stage(HeatSplit(), Stage)
    stage.settings.ranker = "attention"
    full = WideDeep(D)
    models = ModelSet("v1", full, LightRanker(D))  # trained with --rankers ""
    merged = [np.arange(5), np.arange(3), np.arange(0)]
    choices = [Choice("full", "ok"), Choice("light", "low_end device"), Choice("full", "ok")]
    ranked = {}
    batch = RankBatch([None] * 3, None, merged, [None] * 3, None, {}, None, None, [], [])
    _, rankers, _ = stage.rank(batch, choices, ranked, models)
    assert rankers == ["wide_deep", "light", None]  # no candidates: nothing ranked
    assert "no attention model in v1: wide_deep" in choices[0].reason
    assert sorted(ranked) == [0, 1] and len(ranked[0]) == 5 and len(ranked[1]) == 3


def test_freshrec_recommend_shows_the_ranker_and_the_variant():
    from freshrec.app.commands import format_reply
    from schemas.records import RecommendReply, ReplyItem

    reply = RecommendReply(
        "r1",
        "u1",
        (ReplyItem("i1", 0.5, ("vector",)),),
        "full",
        "ok",
        1_767_225_600_000,
        model_version="v1",
        worker="w0",
        experiment="e",
        variant="a",
        ranker="attention",
    )
    head = format_reply(reply, 3.0).splitlines()[0]
    assert head.endswith("model attention v1, worker w0, variant e/a"), head


def test_a_batch_the_device_has_no_memory_for_is_split_and_a_request_that_never_fits_is_served_hot():
    """A fake allocator failure (``torch.OutOfMemoryError``, what CUDA raises) past a number of
    candidates: the batch is scored in halves, each request as it would have been; a request
    too large even alone goes to the hot tier, counted, and the others keep their scores."""
    from freshcore import metrics as m

    class Stage(RankingStage):
        def _inputs(self, b, group, realtime_features):  # each request's pairs its own
            parts = [_pairs(len(b.merged[j]), seed=j, requests=1) for j in group]
            owner = np.repeat(np.arange(len(group)), [len(x) for x in parts])
            x = RankInputs(
                *(np.concatenate([getattr(p, f) for p in parts]) for f in RANK_FIELDS), owner
            )
            return x, None, np.zeros((len(owner), 4), np.float32)

    class Tight(WideDeep):
        limit = 12

        def forward_grouped(self, users, owner, item, *rest, **kw):
            if len(owner) > self.limit:
                raise torch.OutOfMemoryError("fake allocator: out of memory")
            return super().forward_grouped(users, owner, item, *rest, **kw)

    RANK_FIELDS = ("user", "item", "dense", "sparse", "cross")
    full = _trained_like(Tight(D))
    models = ModelSet("v", full, LightRanker(D))
    merged = [np.arange(5), np.arange(4), np.arange(6), np.arange(3)]

    def run():
        stage = _stage(HeatSplit(), Stage)
        choices = [Choice("full", "ok") for _ in merged]
        ranked = {}
        batch = RankBatch([None] * 4, None, merged, [None] * 4, None, {}, None, None, [], [])
        _, rankers, _ = stage.rank(batch, choices, ranked, models)
        return ranked, rankers, choices

    Tight.limit = 100
    whole, _, _ = run()
    Tight.limit = 12
    before = m.RANKING_OOM.labels("wide_deep")._value.get()
    ranked, rankers, choices = run()
    for j in range(4):  # in halves, each request scored as in one pass
        torch.testing.assert_close(ranked[j], whole[j])
    assert rankers == ["wide_deep"] * 4 and sorted(ranked) == [0, 1, 2, 3]
    assert [len(ranked[j]) for j in range(4)] == [5, 4, 6, 3]
    assert m.RANKING_OOM.labels("wide_deep")._value.get() > before
    Tight.limit = 5  # request 2 (6 candidates) never fits
    try:
        ranked, rankers, choices = run()
    finally:
        Tight.limit = 12
    assert rankers == ["wide_deep", "wide_deep", None, "wide_deep"]
    assert choices[2].tier == "hot" and "out of device memory" in choices[2].reason
    assert sorted(ranked) == [0, 1, 3]
