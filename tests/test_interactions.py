"""Interaction logs from files (``inference/training/interactions.py``) and the training rows made of
them (``inference/training/logtrain.py``): every format, bad rows, and logs that cannot be used."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from inference.training.interactions import LogError, LogFormat, parse_time, preset, read_log
from inference.training.logtrain import (
    ItemFormat,
    chronological_split,
    read_items,
    training_log,
)

FMT = LogFormat("user", "item", "ts")
ROWS = [("a", "x", 1_700_000_002), ("b", "y", 1_700_000_001), ("a", "z", 1_700_000_003)]


def _csv(rows, header="user,item,ts", sep=",") -> str:
    return "\n".join([header, *(sep.join(map(str, r)) for r in rows)]) + "\n"


def _check(log) -> None:
    assert log.users.tolist() == ["b", "a", "a"]  # event-time order
    assert log.items.tolist() == ["y", "x", "z"]
    assert log.t_ms.tolist() == [1_700_000_001_000, 1_700_000_002_000, 1_700_000_003_000]
    assert log.bad.count == 0


def test_csv_tsv_jsonl_and_gzip_read_the_same(tmp_path):
    (tmp_path / "a.csv").write_text(_csv(ROWS))
    (tmp_path / "a.tsv").write_text(_csv(ROWS, "user\titem\tts", "\t"))
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"user": u, "item": i, "ts": t}) + "\n" for u, i, t in ROWS)
    )
    with gzip.open(tmp_path / "a.csv.gz", "wt") as f:
        f.write(_csv(ROWS))
    for name in ("a.csv", "a.tsv", "a.jsonl", "a.csv.gz"):
        _check(read_log(tmp_path / name, FMT))


def test_times_in_seconds_milliseconds_and_iso_8601():
    assert parse_time("1700000000", "auto") == 1_700_000_000_000
    assert parse_time("1700000000123", "auto") == 1_700_000_000_123
    assert parse_time(1700000000.5, "auto") == 1_700_000_000_500
    assert parse_time("2023-11-14T22:13:20Z", "auto") == 1_700_000_000_000
    assert parse_time("2023-11-14 22:13:20", "auto") == 1_700_000_000_000  # naive: UTC
    assert parse_time("1700000000", "ms") == 1_700_000_000
    with pytest.raises(ValueError):
        parse_time("yesterday", "auto")
    with pytest.raises(ValueError):
        parse_time("nan", "auto")
    with pytest.raises(ValueError, match="outside years"):
        parse_time("100E304", "s")  # finite in seconds, infinite in ms


def test_movielens_preset_reads_ratings_csv_u_data_and_ratings_dat(tmp_path):
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n1,10,4.0,964982703\n2,20,3.5,964982224\n"
    )
    (tmp_path / "u.data").write_text("1\t10\t4\t964982703\n2\t20\t3\t964982224\n")
    (tmp_path / "ratings.dat").write_text("1::10::4::964982703\n2::20::3::964982224\n")
    for name in ("ratings.csv", "u.data", "ratings.dat"):
        path = tmp_path / name
        log = read_log(path, preset("movielens", path))
        assert log.users.tolist() == ["2", "1"] and log.items.tolist() == ["20", "10"], name
    path = tmp_path / "ratings.csv"
    fmt = preset("movielens", path)
    liked = read_log(path, LogFormat(**{**fmt.__dict__, "min_rating": 4.0}))
    assert liked.items.tolist() == ["10"] and liked.bad.skipped == 1


def test_bad_rows_are_counted_and_the_first_ones_reported_with_their_lines(tmp_path):
    lines = ["user,item,ts", "a,x,1700000000", ",y,1700000001", "b,y,never"]
    lines += ["c,z"] + [f"d{i},{'w' * 80},1700000002" for i in range(6)] + ["e,v,1700000003"]
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    log = read_log(tmp_path / "bad.csv", FMT)
    assert log.users.tolist() == ["a", "e"]
    assert log.bad.count == 9
    assert log.bad.examples[:3] == [
        (3, "empty user id"),
        (4, "time 'never' is neither epoch seconds, ms nor ISO 8601"),
        (5, "no time"),
    ]
    assert len(log.bad.examples) == 5 and "9 bad rows (first 5)" in log.bad.summary()
    assert log.lines.tolist() == [2, 12]


def test_event_types_map_to_clicks_and_conversions_and_the_rest_is_skipped(tmp_path):
    (tmp_path / "ev.csv").write_text("user,item,ts,kind\na,x,1,view\na,y,2,buy\na,z,3,wishlist\n")
    fmt = LogFormat(
        "user", "item", "ts", type_col="kind", types={"view": "click", "buy": "conversion"}
    )
    log = read_log(tmp_path / "ev.csv", fmt)
    assert log.types.tolist() == ["click", "conversion"] and log.bad.skipped == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "the file is empty"),
        ("user,item,ts\n,,\n", "no usable interaction; 1 bad rows"),
        ("u,i,t\na,b,1\n", "no column 'user' in its header"),
        (b"user,item,ts\n\xff\xfe,x,1\n", "not UTF-8 text"),
    ],
)
def test_an_unusable_log_is_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "log.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(LogError, match=message) as err:
        read_log(path, FMT)
    assert "\n" not in str(err.value)


def test_a_missing_file_or_a_directory_is_a_one_line_error(tmp_path):
    with pytest.raises(LogError, match="cannot be read"):
        read_log(tmp_path / "nope.csv", FMT)
    with pytest.raises(LogError, match="is a directory"):
        read_log(tmp_path, FMT)


def test_item_files_movielens_genres_and_generic_columns(tmp_path):
    (tmp_path / "movies.csv").write_text(
        'movieId,title,genres\n1,Toy Story (1995),Adventure|Animation\n2,"Heat, The",Action\n'
    )
    t = read_items(tmp_path / "movies.csv", ItemFormat(), movielens=True)
    assert t.ids == ["1", "2"] and t.category == {"1": "Adventure", "2": "Action"}
    flags = "|".join(["0"] * 19)
    (tmp_path / "u.item").write_text(f"7|Film|01-Jan-1995||http://x|{flags[:-1]}1\n")
    t = read_items(tmp_path / "u.item", ItemFormat(), movielens=True)
    assert t.category == {"7": "Western"}
    (tmp_path / "items.tsv").write_text("item_id\tcategory\tprice\nx\tbooks\t9.5\ny\t\t-1\n")
    t = read_items(tmp_path / "items.tsv", ItemFormat())
    assert t.category == {"x": "books"} and t.price == {"x": 9.5}


def test_training_rows_sample_negatives_uniformly_and_split_by_time(tmp_path):
    (tmp_path / "l.csv").write_text(
        _csv([(f"u{j % 7}", f"i{j % 11}", 1000 + j) for j in range(200)])
    )
    inter = read_log(tmp_path / "l.csv", FMT)
    items = read_items(_items_file(tmp_path), ItemFormat())
    logs = training_log(inter, items, negatives=3, rng=np.random.default_rng(0))
    assert len(logs) == 800 and logs.clicked.sum() == 200 and logs.sampled.sum() == 600
    pos = np.flatnonzero(logs.clicked)
    assert (logs.items[pos + 1] != logs.items[pos]).all()  # never the positive itself
    assert len(logs.item_ids) == 12  # the log's eleven and the item file's extra one
    train_idx, valid_idx, test_idx = chronological_split(logs, 0.1)
    assert logs.t_ms[train_idx].max() < logs.t_ms[test_idx].min()
    assert len(test_idx) == 80 and (valid_idx == test_idx).all()


def _items_file(tmp_path):
    path = tmp_path / "items.csv"
    path.write_text("item_id,category\n" + "".join(f"i{j},c{j % 3}\n" for j in range(12)))
    return path


def test_a_time_past_the_calendar_is_a_counted_bad_row_not_a_crash(tmp_path):
    """1e19 parses as a number, but no int64 of milliseconds holds it: a bad row."""
    path = tmp_path / "log.csv"
    path.write_text(_csv([("u1", "i1", "1e19"), ("u1", "i2", "-1e17"), ("u2", "i1", 1600000000)]))
    log = read_log(path, FMT)
    assert log.items.tolist() == ["i1"] and log.bad.count == 2
    assert "outside years 1 to 9999" in log.bad.examples[0][1]


def test_a_log_without_times_keeps_each_users_order_on_a_seeded_clock(tmp_path):
    from inference.training.interactions import SYNTHETIC_SPAN_MS, SYNTHETIC_START_MS

    rows = [("u1", "a"), ("u1", "b"), ("u2", "c"), ("u1", "d"), ("u2", "e"), ("u3", "f")]
    rows += [(f"v{j % 7}", f"i{j}") for j in range(200)]
    path = tmp_path / "seq.inter"
    path.write_text("user_id:token\titem_id:token\n" + "".join(f"{u}\t{i}\n" for u, i in rows))
    fmt = LogFormat("user_id:token", "item_id:token", "")
    log = read_log(path, fmt)
    assert len(log) == len(rows) and log.bad.count == 0
    for user in {u for u, _ in rows}:
        in_file = [i for u, i in rows if u == user]
        assert [i for u, i in zip(log.users, log.items, strict=True) if u == user] == in_file
    assert (np.diff(log.t_ms) >= 0).all()
    assert log.t_ms.min() >= SYNTHETIC_START_MS and log.t_ms.max() < (
        SYNTHETIC_START_MS + SYNTHETIC_SPAN_MS
    )
    # users interleave: the first hundred events are not one user's
    assert len(set(log.users[:100].tolist())) > 3
    again = read_log(path, fmt)
    assert again.t_ms.tolist() == log.t_ms.tolist()
    other = read_log(path, LogFormat("user_id:token", "item_id:token", "", clock_seed=1))
    assert other.t_ms.tolist() != log.t_ms.tolist()


def test_no_time_and_a_time_column_are_refused_together(tmp_path):
    import argparse

    from freshrec.app.options import add_log_options, log_format_from_args

    p = argparse.ArgumentParser()
    add_log_options(p)
    args = p.parse_args(["--no-time", "--time-col", "ts"])
    with pytest.raises(LogError, match="--no-time"):
        log_format_from_args(args, str(tmp_path / "x.csv"))
    assert log_format_from_args(p.parse_args(["--no-time"]), "x.csv").time_col == ""
