"""The dashboard's and ``freshrec top``'s headline figures, from scraped samples."""

from __future__ import annotations

from freshrec.app.observe import NEWEST, headline
from freshrec.app.top import render


def newest(*stages: tuple[str, float]) -> dict:
    return {NEWEST: [({"stage": stage}, value) for stage, value in stages]}


def test_the_global_path_behind_local_is_the_newest_event_time_learnt_minus_reached():
    # two workers (one has installed nothing yet: 0) and a parameter server, merged
    after = newest(
        ("local", 100.0),
        ("local", 101.5),
        ("served", 100.9),
        ("served", 0.0),
        ("global_applied", 101.2),
    )
    h = headline((0.0, {}, {}), (1.0, after, {"worker": True}))
    assert h.behind_s == {"global_applied": 0.3, "served": 0.6}
    assert "behind     global_applied 0.30 s  served 0.60 s" in render(h)


def test_nothing_reached_yet_is_shown_as_unknown_not_as_a_lag():
    h = headline((0.0, {}, {}), (1.0, newest(("local", 100.0)), {}))
    assert h.behind_s == {"global_applied": None, "served": None}
    assert "global_applied –  served –" in render(h)
    assert headline((0.0, {}, {}), (1.0, {}, {})).behind_s == {
        "global_applied": None,
        "served": None,
    }
