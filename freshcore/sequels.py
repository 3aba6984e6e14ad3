"""Sequential rules: what follows an item in users' click sequences (Ludewig & Jannach,
"Evaluation of session-based recommendation algorithms", UMUAI 2018: rule(a → b) += 1/d for
every b that followed a within d steps of the same user's sequence). The parts every side
shares. Pure.

- ``UserSequences``: which earlier items a click follows, and how far back (the streams
  app's validate stage makes the pairs live; ``freshrec train --log`` makes them alike for
  the ranking feature). A user's sequence is their clicks in the order the stream holds them
  (``events`` is keyed by user), a consecutive repeat of the same item collapsed, as SR does.
- The successor lists in Redis: written by the streams app's count stage, read by the
  worker's ``sequel`` recall channel. One hash per ``events.by_item`` partition
  (``RedisKeys.sequel``), field = anchor item id, value = the JSON of
  ``neighbours.serving_list``: ``[[successor, …], [share, …]]``, best first, the share of a
  successor b being r(a → b) / Σ_b' r(a → b') over the anchor's counted successors.
- ``successor_scores``: a user's score of an item from those lists, Σ 0.5^age · share(a → b)
  over the user's newest ``SEQUEL_ANCHORS`` distinct clicks a (age 0: the item just
  consumed): the channel's ranking of its candidates and the ranking models' ``sequel``
  feature.

>>> s = UserSequences(users=10, steps=3)
>>> s.follows("u", "a", 1), s.follows("u", "b", 2), s.follows("u", "b", 3), s.follows("u", "a", 4)
([], [('a', 1)], [], [('b', 1)])
>>> s.follows("u", "c", 5)
[('a', 1), ('b', 2), ('a', 3)]
>>> successor_scores(["b", "a"], {"b": [("x", 0.75), ("a", 0.25)], "a": [("x", 1.0)]})
{'x': 1.25}
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from freshcore.neighbours import ANCHORS, decayed_sum

SEQUEL_STEPS = 10
"""A click follows the user's last this many items of their sequence
(``FRESHREC_SEQUEL_STEPS``)."""
SEQUEL_ANCHORS = 3
"""A user's newest distinct clicks whose successors are scored (the newest weighs most)."""
SEQUEL_DECAY = 0.5
"""Weight of the anchor clicked ``age`` distinct clicks ago (newest 0): 0.5^age. SR scores
the last item alone; the two before it break its ties and speak for a user whose last item
has no rules yet."""


def successor_scores(
    recent: Sequence[str], lists: Mapping[str, Iterable[tuple[str, float]]]
) -> dict[str, float]:
    """Each successor's Σ 0.5^age · share(a → b) over the newest ``SEQUEL_ANCHORS`` distinct
    items of ``recent`` (the user's clicks, newest first); the user's own recent items (the
    newest ``ANCHORS`` distinct) are left out.

    >>> successor_scores(["a", "b"], {"a": [("x", 0.5), ("b", 0.5)], "b": [("x", 1.0)]})
    {'x': 1.0}
    """
    distinct = list(dict.fromkeys(recent))
    return decayed_sum(distinct[:SEQUEL_ANCHORS], lists, SEQUEL_DECAY, set(distinct[:ANCHORS]))


def successor_score_of(item, recent: Sequence, share: Callable[[object, object], float]) -> float:
    """``successor_scores``'s score of one ``item``, from ``share(a, item)`` (0 when ``item``
    is one of the user's own recent items): for counts held in memory.

    >>> successor_score_of("x", ["a", "b"], lambda a, b: {"a": 0.5, "b": 1.0}[a])
    1.0
    """
    distinct = list(dict.fromkeys(recent))
    if item in distinct[:ANCHORS]:
        return 0.0
    return sum(
        SEQUEL_DECAY**age * share(a, item) for age, a in enumerate(distinct[:SEQUEL_ANCHORS])
    )


class UserSequences:
    """Each user's last ``steps`` items of their click sequence, oldest first (a consecutive
    repeat collapsed), bounded in users (the least recently active leave)."""

    def __init__(self, users: int, steps: int) -> None:
        self.users, self.steps = users, steps
        self._sequences: OrderedDict[str, deque[str]] = OrderedDict()
        self._seeded: dict[str, list[tuple[str, int]]] = {}
        """Users seeded and not clicked since: their recent clicks, oldest first, whole."""

    def __contains__(self, user: str) -> bool:
        return user in self._sequences

    def seed(self, user: str, clicks: Iterable[tuple[str, int]]) -> None:
        """Start ``user``'s sequence from clicks known elsewhere: their recent clicks (item,
        time), newest first, repeats included, as the streams app keeps them in Redis. Until
        the user's next click they are held whole: after a crash, a batch replayed may find
        its own clicks there already, and a click that finds itself (the same item and
        time) follows only what came before it."""
        self._seeded[user] = list(clicks)[::-1]
        self._sequences[user] = deque(maxlen=self.steps)
        self._sequences.move_to_end(user)
        self._trim()

    def follows(self, user: str, item: str, ts: int) -> list[tuple[str, int]]:
        """The items ``user``'s click on ``item`` at ``ts`` follows and their distance (1: the
        item just before), nearest first; the click then joins the sequence. A consecutive
        repeat follows nothing and does not join; an earlier place of ``item`` itself in the
        sequence makes no pair (a rule a → a is never served)."""
        sequence = self._sequences.get(user)
        if sequence is None:
            sequence = self._sequences[user] = deque(maxlen=self.steps)
            self._trim()
        else:
            self._sequences.move_to_end(user)
        seeded = self._seeded.pop(user, None)
        if seeded is not None:
            sequence.extend(collapsed(_before(seeded, (item, ts))))
        if sequence and sequence[-1] == item:
            return []
        out = [(a, d) for d, a in enumerate(reversed(sequence), 1) if a != item]
        sequence.append(item)
        return out

    def _trim(self) -> None:
        while len(self._sequences) > self.users:
            user, _ = self._sequences.popitem(last=False)
            self._seeded.pop(user, None)


def collapsed(clicks: Iterable[tuple[str, int]]) -> list[str]:
    """The items of ``clicks`` (oldest first), a consecutive repeat collapsed.

    >>> collapsed([("a", 1), ("a", 2), ("b", 3), ("a", 4)])
    ['a', 'b', 'a']
    """
    out: list[str] = []
    for item, _ in clicks:
        if not out or out[-1] != item:
            out.append(item)
    return out


def _before(clicks: list[tuple[str, int]], click: tuple[str, int]) -> list[tuple[str, int]]:
    """``clicks`` (oldest first) before the last place of ``click`` in them; all of them
    when it is not there.

    >>> _before([("a", 1), ("b", 2), ("c", 3)], ("b", 2)), _before([("a", 1)], ("b", 2))
    ([('a', 1)], [('a', 1)])
    """
    for j in range(len(clicks) - 1, -1, -1):
        if clicks[j] == click:
            return clicks[:j]
    return clicks
