"""Brute-force reference implementations of the replay's three streaming baselines, for tests.

Item kNN, sequential rules ("SR", Ludewig & Jannach 2018) and STAN (Garg et al., SIGIR 2019),
written independently from their specification alone (``BASELINE_SPEC.md``), without looking
at the project's own implementations, so that tests can check those against these as oracles.

They are deliberately plain: dicts, sets, lists and loops in pure Python float64 arithmetic.
``learn`` only stores the state the specification names; every score is recomputed from that
state, by the specification's formulas, on every ``recommend`` (no incremental tricks). Each is
meant for logs of a few hundred interactions, not for speed.

Shared by all three (``_Brute``):

- ``learn(users, items, t_ms=None)`` applies a batch one interaction at a time; with
  ``t_ms=None`` the i-th interaction ever learnt (over all calls, from 0) has time ``i * 1000``.
- the vocabulary: items numbered in order of first occurrence in any ``learn``;
- ``n(b)``: the number of distinct users who interacted with ``b`` (kept as a set of users);
- ``scores(user)``: every vocabulary item's score (0.0 where nothing gives it one), in
  vocabulary order, without the tie-break term; ``recommend`` ranks exactly these;
- ``recommend(user, k, exclude)``: sorts by ``score + 1e-9 * n(b) / max n`` descending, then by
  vocabulary order, skips ``exclude`` and returns the first ``k``. It never changes state.

>>> BruteItemKNN(window=2, alpha=0.5, recency=1.0).recommend("u", 3, set())
[]
"""

from __future__ import annotations

import abc
import math
from collections.abc import Container, Sequence


class _Brute(abc.ABC):
    """The vocabulary, n(b), event times and the common ranking; subclasses add their state."""

    def __init__(self) -> None:
        self.vocab: list[str] = []  # items in order of first occurrence
        self.vocab_index: dict[str, int] = {}  # item -> its vocabulary number
        self.users_of: dict[str, set[str]] = {}  # item -> the distinct users who had it
        self.count = 0  # interactions learnt so far, over all calls

    def n(self, item: str) -> int:
        return len(self.users_of.get(item, set()))

    def learn(
        self, users: Sequence[str], items: Sequence[str], t_ms: Sequence[int] | None = None
    ) -> None:
        users = list(users)
        items = list(items)
        if len(users) != len(items):
            raise ValueError("users and items differ in length")
        if t_ms is not None and len(t_ms) != len(users):
            raise ValueError("t_ms and users differ in length")
        for pos in range(len(users)):
            u = users[pos]
            i = items[pos]
            t = self.count * 1000 if t_ms is None else int(t_ms[pos])
            if i not in self.vocab_index:
                self.vocab_index[i] = len(self.vocab)
                self.vocab.append(i)
            self.learn_one(u, i, t)  # sees n(i) as it was before this interaction
            if i not in self.users_of:
                self.users_of[i] = set()
            self.users_of[i].add(u)
            self.count += 1

    @abc.abstractmethod
    def learn_one(self, u: str, i: str, t: int) -> None:
        """One interaction into the subclass's state, before n(i) counts it."""

    @abc.abstractmethod
    def scores(self, user: str) -> dict[str, float]:
        """The candidates' scores for ``user`` from that state."""

    def recommend(self, user: str, k: int, exclude: Container[str] | None) -> list[str]:
        if not self.vocab:
            return []
        if exclude is None:
            exclude = set()
        score = self.scores(user)
        max_n = max(self.n(b) for b in self.vocab)
        keyed = []
        for b in self.vocab:
            final = float(score[b]) + 1e-9 * self.n(b) / max_n
            keyed.append((-final, self.vocab_index[b], b))
        keyed.sort()
        out: list[str] = []
        for _, _, b in keyed:
            if len(out) >= k:
                break
            if b in exclude:
                continue
            out.append(b)
        return out


def _to_front(items: list[str], i: str, size: int) -> None:
    """Put ``i`` first in the newest-first list ``items`` (removing it from where it was), then
    cut the list to its ``size`` newest."""
    if i in items:
        items.remove(i)
    items.insert(0, i)
    while len(items) > size:
        items.pop()


class BruteItemKNN(_Brute):
    """Item kNN over users' windows of their last ``window`` distinct items (spec section 1).

    Example 1: a first learn, a recommend, then a second learn that changes the answer; both
    levels of the tie-break.

    >>> m = BruteItemKNN(window=2, alpha=0.5, recency=1.0)
    >>> m.learn(["u", "u", "v", "v"], ["a", "b", "a", "c"])

    # By hand. u,a: win[u]=[a], n(a)=1. u,b: c(a,b)=1, win[u]=[b,a], n(b)=1.
    # v,a: win[v]=[a], n(a)=2. v,c: c(a,c)=1, win[v]=[c,a], n(c)=1.
    # Vocabulary a, b, c; n = 2, 1, 1, max 2. For u, win=[b,a]; term of (p, a_p, b) is
    # 1^p * c(a_p, b) / (n(a_p)^0.5 * n(b)^0.5):
    #   score(a) = c(b,a)/(1*sqrt2) + c(a,a)/(...)   = 1/sqrt2 + 0 = 0.707107
    #   score(b) = c(b,b)/(...)     + c(a,b)/(sqrt2*1) = 0 + 1/sqrt2 = 0.707107
    #   score(c) = c(b,c)/(...)     + c(a,c)/(sqrt2*1) = 0 + 1/sqrt2 = 0.707107
    # All three tie exactly; tie term 1e-9*n/max: a 1e-9, b 0.5e-9, c 0.5e-9, so a first;
    # b and c still tie exactly, so vocabulary order: b (1) before c (2).

    >>> {b: round(s, 6) for b, s in m.scores("u").items()}
    {'a': 0.707107, 'b': 0.707107, 'c': 0.707107}
    >>> m.recommend("u", 3, set())
    ['a', 'b', 'c']
    >>> m.recommend("u", 3, {"a"})
    ['b', 'c']
    >>> m.learn(["w", "w"], ["c", "b"])

    # By hand. w,c: win[w]=[c], n(c)=2. w,b: c(c,b)=1, win[w]=[b,c], n(b)=2. Now every n is 2,
    # so every denominator is sqrt2*sqrt2 = 2. For u, win=[b,a]:
    #   score(a) = c(b,a)/2 + c(a,a)/2 = 1/2 + 0   = 0.5
    #   score(b) = c(b,b)/2 + c(a,b)/2 = 0 + 1/2   = 0.5
    #   score(c) = c(b,c)/2 + c(a,c)/2 = 1/2 + 1/2 = 1.0
    # c first; a and b tie exactly with equal n, so vocabulary order: a, b.

    >>> {b: round(s, 6) for b, s in m.scores("u").items()}
    {'a': 0.5, 'b': 0.5, 'c': 1.0}
    >>> m.recommend("u", 3, set())
    ['c', 'a', 'b']

    Example 2: a re-consumed item moves to the front of the window, with no new co-occurrence,
    and the window is cut back to ``window`` items; alpha 0 and recency 0.5.

    >>> m = BruteItemKNN(window=2, alpha=0.0, recency=0.5)
    >>> m.learn(["u", "u", "u", "u"], ["a", "b", "c", "a"])

    # By hand. u,a: win=[a]. u,b: c(a,b)=1, win=[b,a]. u,c: c(b,c)=1, c(a,c)=1, win=[c,b]
    # (a dropped). u,a: a is in had[u], so only win=[a,c,b] cut to [a,c]. n(a)=n(b)=n(c)=1.
    # alpha 0: the denominator is n(a_p). For u, win=[a,c]:
    #   score(a) = c(a,a)/1 + 0.5*c(c,a)/1 = 0 + 0.5*1 = 0.5
    #   score(b) = c(a,b)/1 + 0.5*c(c,b)/1 = 1 + 0.5*1 = 1.5
    #   score(c) = c(a,c)/1 + 0.5*c(c,c)/1 = 1 + 0     = 1.0

    >>> m.recommend("u", 3, set())
    ['b', 'c', 'a']
    >>> m.learn(["v", "v"], ["d", "c"])

    # By hand. v,d: win[v]=[d], n(d)=1. v,c: c(d,c)=1, n(c)=2. For u, win=[a,c]:
    #   score(b) = c(a,b)/n(a) + 0.5*c(c,b)/n(c) = 1/1 + 0.5*1/2 = 1.25
    #   score(c) = c(a,c)/n(a) + 0.5*c(c,c)/n(c) = 1/1 + 0       = 1.0
    #   score(d) = c(a,d)/n(a) + 0.5*c(c,d)/n(c) = 0 + 0.5*1/2   = 0.25
    # (Had win not been cut back to 2, b (1.25) and c (1 + 0.25*c(b,c)/n(b) = 1.25) would tie
    # and c, of larger n, would come first.)

    >>> m.recommend("u", 4, {"a"})
    ['b', 'c', 'd']

    # A user never seen: every score 0, popularity only: c (n 2), then a, b, d (n 1) in
    # vocabulary order.

    >>> m.recommend("nobody", 2, set())
    ['c', 'a']
    """

    def __init__(self, window: int, alpha: float, recency: float) -> None:
        super().__init__()
        self.window = window
        self.alpha = alpha
        self.recency = recency
        self.had: dict[str, set[str]] = {}  # user -> the items they consumed
        self.win: dict[str, list[str]] = {}  # user -> last `window` distinct items, newest first
        self.c: dict[tuple[str, str], int] = {}  # (a, b) -> co-occurrence count, symmetric

    def learn_one(self, u: str, i: str, t: int) -> None:
        if u not in self.had:
            self.had[u] = set()
            self.win[u] = []
        had = self.had[u]
        win = self.win[u]
        if i in had:
            _to_front(win, i, self.window)
            return
        for a in win:
            self.c[(a, i)] = self.c.get((a, i), 0) + 1
            self.c[(i, a)] = self.c.get((i, a), 0) + 1
        had.add(i)  # n(i) += 1: the base class adds u to the users of i
        _to_front(win, i, self.window)

    def scores(self, user: str) -> dict[str, float]:
        win = self.win.get(user, [])
        out: dict[str, float] = {}
        for b in self.vocab:
            s = 0.0
            for p in range(len(win)):
                a = win[p]
                numerator = self.recency**p * self.c.get((a, b), 0)
                denominator = max(self.n(a), 1) ** (1 - self.alpha) * max(self.n(b), 1) ** (
                    self.alpha
                )
                s += numerator / denominator
            out[b] = s
        return out


class BruteSequentialRules(_Brute):
    """Sequential rules with weight 1/d over the last ``steps`` items (spec section 2).

    Example 1: a recommend between two learns, ties broken first by vocabulary order, then by n.

    >>> m = BruteSequentialRules(steps=2)
    >>> m.learn(["u", "u", "u", "u"], ["a", "b", "b", "c"])

    # By hand. u,a: hist=[a]. u,b: r(a->b)+=1/1, hist=[a,b]. u,b: a consecutive repeat,
    # nothing. u,c: r(b->c)+=1/1, r(a->c)+=1/2, hist=[a,b,c] cut to [b,c].
    # For u, last=c: no rule from c, every score 0; n(a)=n(b)=n(c)=1, so vocabulary order.

    >>> m.recommend("u", 3, set())
    ['a', 'b', 'c']
    >>> m.learn(["v", "v"], ["c", "a"])

    # By hand. v,c: hist[v]=[c], n(c)=2. v,a: r(c->a)+=1, n(a)=2, hist[v]=[c,a].
    # For u, last=c: a 1, b 0, c 0; b and c tie on 0, n(c)=2 > n(b)=1, so c before b.
    # For v, last=a: r(a->b)=1, r(a->c)=0.5, r(a->a)=0.

    >>> m.recommend("u", 3, set())
    ['a', 'c', 'b']
    >>> m.recommend("v", 3, set())
    ['b', 'c', 'a']
    >>> m.recommend("u", 1, {"a"})
    ['c']

    Example 2: a non-consecutive repeat stays in the history, making a self-rule, and its
    two occurrences both give rules to the next item.

    >>> m = BruteSequentialRules(steps=3)
    >>> m.learn(["w", "w", "w", "w"], ["x", "y", "x", "z"])

    # By hand. w,x: hist=[x]. w,y: r(x->y)+=1, hist=[x,y]. w,x (not consecutive):
    # d=1 y: r(y->x)+=1; d=2 x: r(x->x)+=1/2; hist=[x,y,x]. w,z: d=1 x: r(x->z)+=1;
    # d=2 y: r(y->z)+=1/2; d=3 x: r(x->z)+=1/3, so r(x->z)=4/3; hist=[y,x,z] (x dropped).
    # q learns x: hist[q]=[x], n(x)=2. For q, last=x: x 0.5, y 1, z 4/3.

    >>> m.learn(["q"], ["x"])
    >>> {b: round(s, 6) for b, s in m.scores("q").items()}
    {'x': 0.5, 'y': 1.0, 'z': 1.333333}
    >>> m.recommend("q", 3, set())
    ['z', 'y', 'x']

    # For w, last=z: no rule from z; popularity: x (n 2), then y, z (n 1) in vocabulary order.

    >>> m.recommend("w", 3, set())
    ['x', 'y', 'z']
    """

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.hist: dict[str, list[str]] = {}  # user -> last `steps` items, oldest first
        self.r: dict[tuple[str, str], float] = {}  # (a, b) -> weight of the rule a -> b

    def learn_one(self, u: str, i: str, t: int) -> None:
        if u not in self.hist:
            self.hist[u] = []
        hist = self.hist[u]
        if len(hist) > 0 and hist[-1] == i:
            return
        for d in range(1, len(hist) + 1):
            a = hist[-d]
            self.r[(a, i)] = self.r.get((a, i), 0.0) + 1 / d
        hist.append(i)
        while len(hist) > self.steps:
            hist.pop(0)

    def scores(self, user: str) -> dict[str, float]:
        hist = self.hist.get(user, [])
        out: dict[str, float] = {}
        for b in self.vocab:
            if len(hist) == 0:
                out[b] = 0.0
            else:
                last = hist[-1]
                out[b] = self.r.get((last, b), 0.0)
        return out


class BruteSTAN(_Brute):
    """STAN, "Sequence and Time Aware Neighborhood", on users' streams (spec section 3).

    ``sample`` or ``neighbours`` of None keep every candidate (a Python slice's reading).

    Example 1: no weights (l1 = l2 = l3 = None); a recommend between two learns where the
    second changes which neighbour wins a tie on sim; ties on score by n, then vocabulary.

    >>> m = BruteSTAN(session=2, window=3, neighbours=1, sample=2, l1=None, l2=None, l3=None)
    >>> m.learn(["v", "v", "w", "w", "u"], ["a", "b", "a", "c", "a"])

    # By hand. Times 0, 1000, 2000, 3000, 4000. seq[v]=[b,a], last_t 1000, first 0;
    # seq[w]=[c,a], last_t 3000, first 1; seq[u]=[a], last_t 4000, first 2. n: a 3, b 1, c 1.
    # S=[a]. Candidates v, w; by last_t: w, v; sample 2 keeps both. sim(v)=sim(w)=1*1=1, the
    # tie goes to w (later last_t); N=[w]: score(c)+=1*1, score(a)+=1*1. b 0.
    # a and c tie on 1: tie terms a 1e-9*3/3, c 1e-9*1/3, so a, c, then b.

    >>> m.recommend("u", 3, set())
    ['a', 'c', 'b']
    >>> m.learn(["v"], ["d"])

    # By hand. Time 5000: seq[v]=[d,b,a], last_t 5000, n(d)=1, vocabulary a, b, c, d.
    # Candidates by last_t: v, w; sims 1 and 1, the tie goes to v now; N=[v]:
    # a, b, d get 1 each, c 0. a (n 3) first; b and d (n 1) in vocabulary order; then c.

    >>> m.recommend("u", 4, set())
    ['a', 'b', 'd', 'c']
    >>> m.recommend("u", 2, {"a"})
    ['b', 'd']

    # A user never seen: popularity only; and recommend learnt nothing about them.

    >>> m.recommend("nobody", 2, set())
    ['a', 'b']
    >>> "nobody" in m.seq or "nobody" in m.first
    False

    Example 2: ``sample`` keeps the most recently active candidates before sim is looked at;
    l1 = l3 = 1, l2 = None; an exact tie on score broken by n.

    >>> log = (["w", "w", "v", "v", "u", "u"], ["d", "b", "a", "c", "a", "b"])

    # By hand. Times 0..5000. seq[w]=[b,d], last_t 1000; seq[v]=[c,a], last_t 3000;
    # seq[u]=[b,a]. Vocabulary d, b, a, c; n: d 1, b 2, a 2, c 1.
    # S=[b,a]: w1(b)=e^0=1, w1(a)=e^-1. Candidates by last_t: v, w.
    # sample 1: only v; sim(v)=1*w1(a)=e^-1; s*(v)=a (q 1); score(a)+=e^-1*e^0 = 0.367879,
    # score(c)+=e^-1*e^-|0-1| = e^-2 = 0.135335; b, d 0: b (n 2) before d (n 1).

    >>> m = BruteSTAN(session=2, window=3, neighbours=1, sample=1, l1=1.0, l2=None, l3=1.0)
    >>> m.learn(*log)
    >>> m.recommend("u", 4, set())
    ['a', 'c', 'b', 'd']

    # sample 2, neighbours 1: v and w kept; sim(w)=w1(b)=1 > sim(v)=e^-1; N=[w]; s*(w)=b (q 0):
    # score(b)+=1*e^0=1, score(d)+=1*e^-1; a, c 0: a (n 2) before c (n 1).

    >>> m = BruteSTAN(session=2, window=3, neighbours=1, sample=2, l1=1.0, l2=None, l3=1.0)
    >>> m.learn(*log)
    >>> m.recommend("u", 4, set())
    ['b', 'd', 'a', 'c']

    # neighbours 2: N=[w,v]: b 1, d 1*e^-1, a e^-1*1, c e^-1*e^-1. a and d tie exactly at
    # e^-1; n(a)=2 > n(d)=1, so a before d.

    >>> m = BruteSTAN(session=2, window=3, neighbours=2, sample=2, l1=1.0, l2=None, l3=1.0)
    >>> m.learn(*log)
    >>> m.recommend("u", 4, set())
    ['b', 'a', 'd', 'c']

    Example 3: recency of neighbours, l2 = 1000 ms, with explicit event times.

    >>> m = BruteSTAN(session=2, window=3, neighbours=2, sample=2, l1=1.0, l2=1000.0, l3=1.0)
    >>> m.learn(["v", "v", "w", "w", "u", "u"], ["a", "c", "d", "b", "a", "b"],
    ...         t_ms=[0, 1000, 2000, 3000, 3000, 4000])

    # By hand. seq[v]=[c,a], last_t 1000; seq[w]=[b,d], last_t 3000; seq[u]=[b,a]; now 4000.
    # S=[b,a]: w1(b)=1, w1(a)=e^-1. sim(w)=e^-(1000/1000)*w1(b)=e^-1;
    # sim(v)=e^-(3000/1000)*w1(a)=e^-4. N=[w,v].
    # w: s*=b (q 0): b += e^-1*1 = 0.367879, d += e^-1*e^-1 = e^-2 = 0.135335.
    # v: s*=a (q 1): a += e^-4*1 = 0.018316, c += e^-4*e^-1 = e^-5 = 0.006738.

    >>> {b: round(s, 6) for b, s in m.scores("u").items()}
    {'a': 0.018316, 'c': 0.006738, 'd': 0.135335, 'b': 0.367879}
    >>> m.recommend("u", 4, set())
    ['b', 'd', 'a', 'c']
    """

    def __init__(
        self,
        session: int,
        window: int,
        neighbours: int,
        sample: int,
        l1: float | None,
        l2: float | None,
        l3: float | None,
    ) -> None:
        super().__init__()
        self.session = session
        self.window = window
        self.neighbours = neighbours
        self.sample = sample
        self.l1 = l1
        self.l2 = l2
        self.l3 = l3
        self.seq: dict[str, list[str]] = {}  # user -> last `window` distinct items, newest first
        self.last_t: dict[str, int] = {}  # user -> time of their latest interaction
        self.first: dict[str, int] = {}  # user -> the order in which they first appeared
        self.now = 0  # time of the latest interaction learnt

    def learn_one(self, u: str, i: str, t: int) -> None:
        if u not in self.first:
            self.first[u] = len(self.first)
            self.seq[u] = []
        _to_front(self.seq[u], i, self.window)
        self.last_t[u] = t
        self.now = t

    def scores(self, user: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.vocab:
            out[b] = 0.0
        s_items = self.seq.get(user, [])[: self.session]
        if len(s_items) == 0:
            return out
        rank: dict[str, int] = {}
        for r in range(len(s_items)):
            rank[s_items[r]] = r
        w1: dict[str, float] = {}
        for j in s_items:
            if self.l1 is None:
                w1[j] = 1.0
            else:
                w1[j] = math.exp(-rank[j] / self.l1)

        candidates = []
        for v in self.seq:
            if v == user:
                continue
            shares = False
            for j in self.seq[v]:
                if j in rank:
                    shares = True
            if shares:
                candidates.append(v)
        candidates.sort(key=lambda v: (-self.last_t[v], self.first[v]))
        kept = candidates[: self.sample]

        sim: dict[str, float] = {}
        for v in kept:
            w2 = 1.0 if self.l2 is None else math.exp(-(self.now - self.last_t[v]) / self.l2)
            total = 0.0
            for j in s_items:  # S ∩ seq[v], summed in S's order (newest first)
                if j in self.seq[v]:
                    total += w1[j]
            sim[v] = w2 * total

        chosen = sorted(kept, key=lambda v: (-sim[v], -self.last_t[v], self.first[v]))
        chosen = chosen[: self.neighbours]

        for v in chosen:  # in that order: highest sim first
            common = [j for j in s_items if j in self.seq[v]]
            s_star = common[0]
            for j in common:
                if rank[j] < rank[s_star]:
                    s_star = j
            q: dict[str, int] = {}
            for pos in range(len(self.seq[v])):
                q[self.seq[v][pos]] = pos
            for b in self.seq[v]:
                w3 = 1.0 if self.l3 is None else math.exp(-abs(q[b] - q[s_star]) / self.l3)
                out[b] += sim[v] * w3
        return out
