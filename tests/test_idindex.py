"""IdIndex, the array-at-a-time map from row ids to slots, against a dict."""

from __future__ import annotations

import numpy as np
import pytest

from freshcore.idindex import IdIndex


def test_matches_a_dict_through_inserts_deletes_growth_rebuilds_and_clears():
    rng = np.random.default_rng(1)
    for trial in range(40):
        ix, ref = IdIndex(int(rng.integers(1, 64))), {}
        # small ids share home buckets in a small table; huge and negative ones use every bit
        pool = rng.choice([rng.integers(-50, 50, 400), rng.integers(-(2**63), 2**63 - 1, 400)])
        pool = np.unique(pool)
        for _ in range(int(rng.integers(1, 25))):
            op = rng.random()
            if op < 0.1:
                ix.clear()
                ref.clear()
            elif op < 0.2:
                keep = [k for k in ref if rng.random() < 0.5]
                slots = rng.integers(0, 10**6, len(keep))
                ix.rebuild(np.array(keep, np.int64), slots)
                ref = dict(zip(keep, slots.tolist(), strict=True))
            elif op < 0.45:  # held ids, some twice, and ids not held
                gone = [k for k in ref if rng.random() < 0.4]
                absent = [int(i) for i in rng.choice(pool, 5) if i not in ref]
                batch = np.array([*gone, *gone[:3], *absent], np.int64)
                ix.delete(batch)
                for k in gone:
                    del ref[k]
            elif op < 0.55 and ref:  # a batch with one id held or repeated: refused whole
                fresh = [int(i) for i in rng.choice(pool, 20) if i not in ref]
                fresh = list(dict.fromkeys(fresh))
                bad = rng.choice(list(ref)) if rng.random() < 0.5 or not fresh else fresh[0]
                batch = np.array([*fresh, bad], np.int64)
                rng.shuffle(batch)
                with pytest.raises(ValueError):
                    ix.insert(batch, np.arange(len(batch)))
            else:
                fresh = [int(i) for i in rng.choice(pool, int(rng.integers(0, 60))) if i not in ref]
                fresh = list(dict.fromkeys(fresh))
                slots = rng.integers(0, 10**6, len(fresh))
                ix.insert(np.array(fresh, np.int64), slots)
                ref.update(zip(fresh, slots.tolist(), strict=True))
            query = np.concatenate([rng.choice(pool, 50), rng.integers(-(2**63), 2**63 - 1, 5)])
            expected = [ref.get(int(i), -1) for i in query]
            assert ix.lookup(query).tolist() == expected, trial
            assert len(ix) == len(ref)
            assert 2 * (len(ix) + ix.deleted) <= len(ix.keys)  # load, tombstones too: <= 1/2


@pytest.mark.parametrize("bad", [[5, 6, 5], [1, 2]], ids=["repeated", "already-held"])
def test_an_insert_of_a_held_or_repeated_id_is_refused_and_changes_nothing(bad):
    ix = IdIndex(4)
    ix.insert(np.array([1, 9, 17, 33]), np.array([0, 1, 2, 3]))
    ix.insert(np.array([25]), np.array([4]))
    ix.delete(np.array([25]))  # a tombstone in 1's chain: probes go on past it
    before = (ix.keys.copy(), ix.vals.copy(), ix.state.copy(), len(ix))
    with pytest.raises(ValueError, match="distinct and not held"):
        ix.insert(np.array(bad), np.arange(len(bad)) + 10)
    assert all(
        np.array_equal(a, b) for a, b in zip(before[:3], (ix.keys, ix.vals, ix.state), strict=True)
    )
    assert len(ix) == before[3]
    assert ix.lookup(np.array([1, 9, 17, 33, 5, 6, 2])).tolist() == [0, 1, 2, 3, -1, -1, -1]


def test_ids_and_slots_must_pair_up():
    with pytest.raises(ValueError, match="3 ids for 2 slots"):
        IdIndex().insert(np.array([1, 2, 3]), np.array([0, 1]))


def test_a_deleted_id_can_be_inserted_again_and_tombstones_go_with_growth():
    ix = IdIndex(8)
    ids = np.arange(0, 160, 16)  # small ids sharing few home buckets: long chains
    ix.insert(ids, np.arange(10))
    ix.delete(ids[::2])
    assert ix.lookup(ids).tolist() == [-1, 1, -1, 3, -1, 5, -1, 7, -1, 9] and ix.deleted == 5
    ix.insert(ids[::2], np.arange(100, 105))  # again, at other slots
    assert ix.lookup(ids).tolist() == [100, 1, 101, 3, 102, 5, 103, 7, 104, 9]
    buckets = len(ix.keys)
    ix.insert(np.arange(1000, 1000 + buckets // 2), np.arange(buckets // 2))  # grows
    assert ix.deleted == 0 and ix.lookup(ids[:2]).tolist() == [100, 1]
