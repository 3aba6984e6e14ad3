"""float16 storage (``FRESHREC_TABLE_DTYPE``, ``FRESHREC_RANKING_DTYPE``): half the bytes,
read and computed in float32, with the results of a float32 table holding the same rounded
rows. The whole worker with both settings keeps its round-trip budget in
``test_host_syncs.py``; fp16 rows on ``embeddings.updates`` round-trip in
``test_rowbatch.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freshcore.settings import SettingsError
from inference.learning.steps import TableSlice, device_local_steps
from inference.models.modelfile import load_model, read_manifest
from inference.models.ranking import holds_half, score
from inference.serving.ann import SCAN_BLOCK, IVFIndex, exact_search
from inference.settings import WorkerSettings
from inference.tables.cache import EmbeddingCache
from schemas.rows import TABLE_ITEM, TABLE_USER

DIM = 8
CPU = torch.device("cpu")


def _store(rows: dict[int, np.ndarray]):
    def fetch(table, ids):
        found = np.array([i in rows for i in ids], bool)
        got = [rows[i] for i in ids if i in rows]
        stacked = np.stack(got) if got else np.zeros((0, DIM + 1), np.float32)
        n = len(got)
        return found, stacked, np.full(n, 3, np.uint64), np.full(n, 1_000, np.int64)

    return fetch


def _half(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def test_a_float16_cache_holds_half_the_bytes_and_reads_float32_rows_rounded_once():
    rng = np.random.default_rng(0)
    stored = {i: rng.standard_normal(DIM + 1).astype(np.float32) for i in range(10)}
    full = EmbeddingCache(DIM, 64, _store(stored), CPU, host_users=8)
    half = EmbeddingCache(DIM, 64, _store(stored), CPU, host_users=8, dtype=torch.float16)
    assert half.users.rows.dtype == torch.float16 and full.users.rows.dtype == torch.float32
    assert half.users.rows.nbytes * 2 == full.users.rows.nbytes
    assert half.items.rows.nbytes * 2 == full.items.rows.nbytes

    ids = np.arange(10)
    slots = half.slots(TABLE_USER, ids)
    got = half.rows(TABLE_USER, slots)
    assert got.dtype == torch.float32
    want = _half(np.stack([stored[i] for i in range(10)]))
    np.testing.assert_array_equal(got.numpy(), want)
    # the float32 table holds the store's rows as they are
    np.testing.assert_array_equal(
        full.rows(TABLE_USER, full.slots(TABLE_USER, ids)).numpy(),
        np.stack([stored[i] for i in range(10)]),
    )

    # steps and installs land rounded to float16
    deltas = np.full((2, DIM + 1), 0.25, np.float32)
    half.add(TABLE_USER, slots[:2], deltas)
    np.testing.assert_array_equal(
        half.gather(TABLE_USER, slots[:2]), _half(want[:2] + _half(deltas))
    )
    row = np.linspace(-1, 1, DIM + 1).astype(np.float32) / 3
    half.install(TABLE_USER, int(slots[3]), row, 9, 2_000)
    half.install_many(TABLE_USER, slots[4:6], np.stack([row, -row]), np.array([9, 9]), [1, 1])
    np.testing.assert_array_equal(half.gather(TABLE_USER, slots[3:6]), _half([row, row, -row]))
    items = half.slots(TABLE_ITEM, np.array([4, 5]))
    half.load_items({7: (row, 2, 5), 8: (-row, 2, 5)})
    assert half.gather(TABLE_ITEM, items).dtype == np.float32


def test_a_float16_row_the_device_lets_go_comes_back_from_host_ram_as_it_was():
    rng = np.random.default_rng(1)
    stored = {i: rng.standard_normal(DIM + 1).astype(np.float32) for i in range(4)}
    half = EmbeddingCache(DIM, 1, _store(stored), CPU, host_users=4, dtype=torch.float16)
    first = half.gather(TABLE_USER, half.slots(TABLE_USER, np.array([0])))
    half.slots(TABLE_USER, np.array([1]))  # the slab of one lets user 0 go to host RAM
    assert len(half.host[TABLE_USER]) == 1
    back = half.gather(TABLE_USER, half.slots(TABLE_USER, np.array([0])))
    np.testing.assert_array_equal(back, first)


def test_the_exact_search_over_float16_rows_finds_what_float32_rows_of_their_values_find():
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(2 * SCAN_BLOCK + 123, DIM + 1, generator=g).half()
    q = torch.randn(5, DIM + 1, generator=g)
    bias = torch.zeros(len(rows))
    bias[7] = -torch.inf  # a row that must not be found
    got = exact_search(q, rows, bias, 20)
    want = exact_search(q, rows.float(), bias, 20)
    np.testing.assert_array_equal(got, want)
    assert 7 not in got


def test_an_ivf_index_over_float16_rows_keeps_half_the_copy_and_searches_as_float32():
    g = torch.Generator().manual_seed(3)
    rows = torch.nn.functional.normalize(torch.randn(3000, DIM, generator=g), dim=1).half()
    eligible = torch.ones(len(rows), dtype=torch.bool)
    half = IVFIndex.build(rows, eligible, cells=16, seed=0)
    full = IVFIndex.build(rows.float(), eligible, cells=16, seed=0)
    assert half.block.dtype == np.float16 and half.block.nbytes * 2 == full.block.nbytes
    q = rows[:4].float()
    got, want = half.search(q, rows, k=5, nprobe=4), full.search(q, rows.float(), k=5, nprobe=4)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_learning_step_on_float16_rows_is_computed_in_float32_and_lands_rounded():
    rows = torch.zeros((3, 2), dtype=torch.float16)
    grads = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    part = TableSlice(rows, torch.tensor([2, 0]), torch.tensor([0, 1]), grads)
    (step,) = device_local_steps([part], lr=0.1, max_norm=10.0)
    assert step.sums.dtype == np.float32
    np.testing.assert_array_equal(step.deltas, np.float32([[-0.1, 0.0], [0.0, -0.3]]))
    np.testing.assert_array_equal(rows.float().numpy(), _half([[0, -0.3], [0, 0], [-0.1, 0]]))


def test_float16_ranking_weights_hold_half_the_bytes_and_score_as_their_rounded_values(model_dir):
    from tools.bench_ranking import batch_inputs

    manifest = read_manifest(model_dir)
    x, _ = batch_inputs(model_dir, manifest, CPU)
    for kind in ("wide_deep", "light"):
        full = load_model(model_dir, manifest, kind, CPU)
        half = load_model(model_dir, manifest, kind, CPU, "float16")
        assert holds_half(half) and not holds_half(full)
        size = sum(p.nbytes for p in full.parameters())
        assert sum(p.nbytes for p in half.parameters()) * 2 == size
        got = score(half, x, CPU)
        assert got.dtype == np.float32 and all(p.dtype == torch.float16 for p in half.parameters())
        # a float32 model holding the rounded weights computes the same thing
        rounded = load_model(model_dir, manifest, kind, CPU)
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.half().float())
        np.testing.assert_allclose(got, score(rounded, x, CPU), rtol=0, atol=1e-6)
        assert np.abs(got - score(full, x, CPU)).max() < 0.01


def test_the_storage_dtypes_are_settings_with_clear_errors():
    env = {"FRESHREC_TABLE_DTYPE": "float16", "FRESHREC_RANKING_DTYPE": "float16"}
    s = WorkerSettings.from_env(env)
    assert (s.table_dtype, s.ranking_dtype) == ("float16", "float16")
    assert WorkerSettings.from_env({}).table_dtype == "float32"
    with pytest.raises(SettingsError, match=r"FRESHREC_TABLE_DTYPE=.* must be one of"):
        WorkerSettings.from_env({"FRESHREC_TABLE_DTYPE": "bfloat16"})
    with pytest.raises(SettingsError, match="FRESHREC_RANKING_DTYPE"):
        WorkerSettings.from_env({"FRESHREC_RANKING_DTYPE": "half"})
