"""A/B experiments: variants declared in a TOML file, users assigned by a salted hash, and
the allocation of hash buckets to variants moved as little as new shares require. Pure.

A user's bucket is BLAKE2b-64 of the salt and the user id, modulo ``BUCKETS``; an allocation
table says which variant owns each bucket. Tables are made by ``allocate``: the first from
nothing (variants in file order over consecutive buckets), each later one from the table in
force, so a share change moves only the buckets the new shares require (a shrinking variant
gives up its highest buckets, a growing one takes the lowest free ones) and every worker,
reading the same table, assigns a user alike across restarts.

>>> exp = parse(EXAMPLE)
>>> [(v.name, v.share) for v in exp.variants], exp.control
([('control', 0.5), ('light', 0.25), ('diverse', 0.25)], 'control')
>>> table = allocate(None, [], exp)
>>> [table.count(i) for i in range(3)]
[500, 250, 250]
>>> exp.variant_of(table, "u42") in {"control", "light", "diverse"}
True
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field

from inference.models.kinds import experiment_rankings
from inference.serving.channels import CHANNELS as REGISTERED_CHANNELS
from schemas.errors import FreshRecError
from schemas.hashing import salted_bucket

BUCKETS = 1000
"""Hash buckets a share is counted in: shares are multiples of 0.1%."""
UNASSIGNED = 255
MAX_VARIANTS = UNASSIGNED - 1
"""A bucket of the allocation table holds its variant's number in a byte, 255 unassigned."""
RANKINGS = experiment_rankings()
"""What a variant's ``ranking`` may name (``inference/models/kinds.py``)."""
CHANNELS = tuple(REGISTERED_CHANNELS)
"""What a variant's ``recall_quotas`` may name: every registered recall channel."""

EXAMPLE = """\
[experiment]
name = "ranking-2026-12"

[[variant]]
name = "control"
share = 0.5

[[variant]]
name = "light"
share = 0.25
ranking = "light"

[[variant]]
name = "diverse"
share = 0.25
mmr_lambda = 0.4
exclude_seen = true
recall_quotas = { hot = 50 }
"""


class ExperimentError(FreshRecError, ValueError):
    """A one-line reason an experiments file is refused, naming the file and line."""


@dataclass(frozen=True)
class Variant:
    name: str
    share: float
    ranking: str | None = None
    """The ranking model of this variant's requests (``RANKINGS``; None: the worker's):
    ``light`` is the light tier; the others replace the full tier's model (``full``:
    Wide&Deep, ``pruned``, the attention rankers, ``tiered``: by item heat). A ladder that
    steps down, for a device, a deadline or a failure, still wins."""
    mmr_lambda: float | None = None
    exclude_seen: bool | None = None
    """Applied to requests that do not say themselves."""
    recall_quotas: dict[str, int] = field(default_factory=dict)
    """Per recall channel, the most candidates it contributes (lower than the worker's)."""
    head_share: float | None = None
    """``tiered`` only: the hottest share of the warm catalogue the full model ranks (None: the
    worker's ``FRESHREC_TIER_HEAD_SHARE``)."""
    mid_share: float | None = None
    """``tiered`` only: the next share, which the pruned model ranks; the rest is the light
    model's (None: ``FRESHREC_TIER_MID_SHARE``)."""


@dataclass(frozen=True)
class Experiment:
    name: str
    salt: str
    control: str
    variants: tuple[Variant, ...]

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def variant_of(self, table: bytes, user_id: str) -> str:
        """The variant that owns the user's bucket in ``table`` (``allocate``'s)."""
        return self.variants[table[bucket(self.salt, user_id)]].name


def bucket(salt: str, user_id: str) -> int:
    """The user's hash bucket under ``salt``: the same in every process and after restarts.

    >>> bucket("s", "u1") == bucket("s", "u1") != bucket("t", "u1")
    True
    """
    return salted_bucket(salt, user_id, BUCKETS)


def target_counts(shares: list[float]) -> list[int]:
    """Buckets per variant: ``shares`` (summing to 1) times ``BUCKETS``, rounded by largest
    remainder so they sum to ``BUCKETS``.

    >>> target_counts([1 / 3, 1 / 3, 1 / 3])
    [334, 333, 333]
    """
    exact = [s * BUCKETS for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: BUCKETS - sum(counts)]:
        counts[i] += 1
    return counts


def allocate(old: bytes | None, old_names: list[str], exp: Experiment) -> bytes:
    """The allocation table for ``exp``'s shares, from ``old`` (whose indices name
    ``old_names``; None: none yet) with the fewest buckets moved: each variant keeps what it
    had up to its new count, releasing its highest buckets beyond it, and variants below
    their count take the lowest free buckets, in file order.

    >>> from dataclasses import replace
    >>> exp = parse(EXAMPLE)
    >>> t1, vs = allocate(None, [], exp), exp.variants
    >>> grown = replace(exp, variants=(replace(vs[0], share=0.4), replace(vs[1], share=0.35), vs[2]))
    >>> t2 = allocate(t1, [v.name for v in vs], grown)
    >>> sum(a != b for a, b in zip(t1, t2))  # 100 buckets from control to light, no more
    100
    """
    names = [v.name for v in exp.variants]
    index = {n: i for i, n in enumerate(names)}
    table = [UNASSIGNED] * BUCKETS
    if old is not None:
        if len(old) != BUCKETS:
            raise ValueError(f"an allocation table has {BUCKETS} buckets, not {len(old)}")
        for b, i in enumerate(old):
            if i != UNASSIGNED and i < len(old_names) and old_names[i] in index:
                table[b] = index[old_names[i]]
    want = target_counts([v.share for v in exp.variants])
    for i, n in enumerate(want):
        mine = [b for b in range(BUCKETS) if table[b] == i]
        for b in mine[n:][::-1] if len(mine) > n else []:
            table[b] = UNASSIGNED
    free = iter(b for b in range(BUCKETS) if table[b] == UNASSIGNED)
    for i, n in enumerate(want):
        for _ in range(n - table.count(i)):
            table[next(free)] = i
    return bytes(table)


# ------------------------------------------------------------------------------------ files
def load(path) -> Experiment:
    """``parse`` of the file at ``path``; an unreadable file is an ``ExperimentError`` too."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ExperimentError(f"{path}: cannot read the experiments file: {exc}") from None
    return parse(text, str(path))


_VARIANT_KEYS = {
    "name",
    "share",
    "ranking",
    "mmr_lambda",
    "exclude_seen",
    "recall_quotas",
    "head_share",
    "mid_share",
}
_EXPERIMENT_KEYS = {"name", "salt", "control"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse(text: str, path: str = "experiments.toml") -> Experiment:
    """The experiment a file declares, or ``ExperimentError`` naming the line at fault."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ExperimentError(f"{path}: {exc}") from None
    except RecursionError:
        raise ExperimentError(f"{path}: nested too deeply to read") from None
    lines = text.splitlines()

    def fail(message: str, key: str, block: int | None = None) -> ExperimentError:
        return ExperimentError(f"{path}:{_line_of(lines, key, block)}: {message}")

    unknown = set(data) - {"experiment", "variant"}
    if unknown:
        key = sorted(unknown)[0]
        raise fail(f"unknown table or key {key!r} (experiment, variant)", key)
    head = data.get("experiment")
    if not isinstance(head, dict):
        raise ExperimentError(f"{path}:1: an [experiment] table with a name is required")
    for key in set(head) - _EXPERIMENT_KEYS:
        raise fail(
            f"unknown key {key!r} in [experiment] ({', '.join(sorted(_EXPERIMENT_KEYS))})", key
        )
    name = head.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise fail("experiment name: 1-64 letters, digits, '.', '_' or '-'", "name")
    raw = data.get("variant")
    if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(v, dict) for v in raw):
        raise ExperimentError(f"{path}:{len(lines)}: at least two [[variant]] tables are required")
    if len(raw) > MAX_VARIANTS:
        raise fail(f"{len(raw)} variants: at most {MAX_VARIANTS}", "name", MAX_VARIANTS)
    variants = [_variant(v, n, fail) for n, v in enumerate(raw)]
    names = [v.name for v in variants]
    for n, v in enumerate(variants):
        if names.index(v.name) != n:
            raise fail(f"variant {v.name!r} is declared twice", "name", n)
    total = sum(v.share for v in variants)
    if abs(total - 1.0) > 1e-9:
        raise fail(f"the variants' shares sum to {total:g}, not 1", "share", len(variants) - 1)
    control = head.get("control", names[0])
    if control not in names:
        raise fail(f"control {control!r} is not a variant ({', '.join(names)})", "control")
    salt = head.get("salt", name)
    if not isinstance(salt, str) or not salt:
        raise fail("salt: a non-empty string", "salt")
    return Experiment(name, salt, control, tuple(variants))


def _variant(v: dict, n: int, fail) -> Variant:
    for key in set(v) - _VARIANT_KEYS:
        raise fail(f"unknown key {key!r} in a variant ({', '.join(sorted(_VARIANT_KEYS))})", key, n)
    name = v.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise fail("variant name: 1-64 letters, digits, '.', '_' or '-'", "name", n)
    share = v.get("share")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise fail(f"variant {name!r}: share must be a number from 0 to 1", "share", n)
    if abs(share * BUCKETS - round(share * BUCKETS)) > 1e-6:
        raise fail(f"variant {name!r}: share {share} is finer than 0.1%", "share", n)
    ranking = v.get("ranking")
    if ranking is not None and ranking not in RANKINGS:
        raise fail(f"variant {name!r}: ranking must be one of {', '.join(RANKINGS)}", "ranking", n)
    fractions = {}
    for key in ("mmr_lambda", "head_share", "mid_share"):
        x = v.get(key)
        if x is not None and (
            isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1
        ):
            raise fail(f"variant {name!r}: {key} must be a number from 0 to 1", key, n)
        fractions[key] = None if x is None else float(x)
    for key in ("head_share", "mid_share"):
        if fractions[key] is not None and ranking != "tiered":
            raise fail(f'variant {name!r}: {key} applies to ranking = "tiered" only', key, n)
    if (fractions["head_share"] or 0) + (fractions["mid_share"] or 0) > 1:
        raise fail(f"variant {name!r}: head_share + mid_share exceed 1", "mid_share", n)
    seen = v.get("exclude_seen")
    if seen is not None and not isinstance(seen, bool):
        raise fail(f"variant {name!r}: exclude_seen must be true or false", "exclude_seen", n)
    quotas = v.get("recall_quotas", {})
    if not isinstance(quotas, dict):
        raise fail(
            f"variant {name!r}: recall_quotas is a table of channel = count", "recall_quotas", n
        )
    for channel, q in quotas.items():
        if channel not in CHANNELS:
            raise fail(
                f"variant {name!r}: unknown recall channel {channel!r} ({', '.join(CHANNELS)})",
                "recall_quotas",
                n,
            )
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise fail(
                f"variant {name!r}: recall quota of {channel} must be a count", "recall_quotas", n
            )
    return Variant(
        name,
        float(share),
        ranking,
        fractions["mmr_lambda"],
        seen,
        {c: int(q) for c, q in quotas.items()},
        fractions["head_share"],
        fractions["mid_share"],
    )


def _line_of(lines: list[str], key: str, block: int | None) -> int:
    """The 1-based line of ``key = …`` inside the ``block``-th ``[[variant]]`` (or the
    ``[experiment]`` table when None); the table's header line if the key is absent."""
    header = re.compile(
        r"^\s*\[\[\s*variant\s*\]\]" if block is not None else r"^\s*\[\s*experiment\s*\]"
    )
    starts = [i for i, text in enumerate(lines) if header.match(text)]
    if not starts:
        return 1
    start = starts[min(block or 0, len(starts) - 1)]
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines)
    )
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start, end):
        if pattern.match(lines[i]):
            return i + 1
    return start + 1
