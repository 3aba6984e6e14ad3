"""The public logs' converters (``tools/public_logs.py``) on small files of each format,
and their one-line errors."""

from __future__ import annotations

import csv

from tools.public_logs import main


def _rows(path):
    with path.open() as f:
        return list(csv.reader(f))


def test_each_format_becomes_the_csv_the_replay_reads(tmp_path):
    (tmp_path / "items.txt").write_text("u1 a b\nu2 c\n")
    (tmp_path / "times.txt").write_text("u1 100 200\nu2 50\n")
    assert (
        main(["ticoserec", *(str(tmp_path / n) for n in ("items.txt", "times.txt", "t.csv"))]) == 0
    )
    assert _rows(tmp_path / "t.csv") == [
        ["user_id", "item_id", "timestamp"],
        ["u1", "a", "100"],
        ["u1", "b", "200"],
        ["u2", "c", "50"],
    ]
    views = "session_id;user_id;item_id;timeframe;eventdate\n7;NA;x;1500;2016-01-02\n"
    (tmp_path / "views.csv").write_text(views)
    assert main(["diginetica", str(tmp_path / "views.csv"), str(tmp_path / "d.csv")]) == 0
    assert _rows(tmp_path / "d.csv")[1] == ["7", "x", str(1451692800 + 1.5)]
    (tmp_path / "a.txt").write_text("SessionId\tItemId\tTime\n1\tp\t10.5\n")
    (tmp_path / "b.txt").write_text("SessionId\tItemId\tTime\n2\tq\t11.0\n")
    files = [str(tmp_path / n) for n in ("a.txt", "b.txt", "s.csv")]
    assert main(["sessions", *files]) == 0
    assert _rows(tmp_path / "s.csv")[1:] == [["1", "p", "10.5"], ["2", "q", "11.0"]]


def test_files_that_disagree_are_a_one_line_error(tmp_path, capsys):
    (tmp_path / "items.txt").write_text("u1 a b\n")
    (tmp_path / "times.txt").write_text("u1 100\n")
    args = [str(tmp_path / n) for n in ("items.txt", "times.txt", "t.csv")]
    assert main(["ticoserec", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"public_logs: {tmp_path / 'items.txt'}:1: the item and time lines disagree"]
