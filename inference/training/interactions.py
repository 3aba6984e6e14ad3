"""Interaction logs from files: who did what to which item, when.

A log is CSV, TSV (``.tsv``, ``.tab``, ``.inter``; ``::``-separated ``.dat`` as MovieLens
1M writes it) or JSON Lines (``.jsonl``, ``.ndjson``), optionally gzipped (``.gz``, or
recognised by its first bytes). ``LogFormat`` names the columns: the user, the item and the
time are required; an event type (mapped to ``click``/``conversion``, other values skipped)
and an explicit rating (``min_rating`` turns ratings into positives) are optional. Times are
epoch seconds or milliseconds (detected from their size, or ``time_unit``) or ISO 8601
strings (UTC when they name no zone). A log with no times at all (``time_col=""``: sequence
files such as the SASRec and RecBole copies of the Amazon review logs, each user's rows in the
order they happened) is laid on a synthetic clock (``synthetic_times``): each user's rows keep
the file's order and fall at seeded random times over ``SYNTHETIC_SPAN_MS``, users interleaved.

Rows that cannot be read are counted, and the first few reported with their line numbers
(``BadRows``); they never stop the read. A log with no usable row, or a file that cannot be
read, is a ``LogError`` with a one-line message.

>>> fmt = LogFormat(user_col="u", item_col="i", time_col="t")
>>> log = parse_rows(iter([(2, {"u": "a", "i": "x", "t": "1700000000"}),
...                        (3, {"u": "", "i": "y", "t": "1700000001"}),
...                        (4, {"u": "b", "i": "y", "t": "1699999999"})]), fmt)
>>> log.users.tolist(), log.items.tolist(), log.t_ms.tolist()
(['b', 'a'], ['y', 'x'], [1699999999000, 1700000000000])
>>> log.bad.count, log.bad.examples
(1, [(3, 'empty user id')])
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from schemas.errors import FreshRecError

MAX_ID_CHARS = 64
"""The events schema's bound on user and item ids."""
BAD_EXAMPLES = 5
MS_THRESHOLD = 100_000_000_000
"""Epoch times at or above this are milliseconds (1973 in ms, year 5138 in seconds)."""
EVENT_TYPES = ("click", "conversion")
SYNTHETIC_START_MS = 1_577_836_800_000
"""A log without times starts at 2020-01-01 UTC ..."""
SYNTHETIC_SPAN_MS = 365 * 86_400_000
"""... and spans a year."""
ROW_ERROR = "\0error"
"""Key of a row that could not be split into cells; its value says why."""


class LogError(FreshRecError, ValueError):
    """The log cannot be used at all: the message is one line, for the user."""


@dataclass(frozen=True)
class LogFormat:
    user_col: str = "user_id"
    item_col: str = "item_id"
    time_col: str = "timestamp"
    """``""``: the log has no times; see ``synthetic_times``."""
    type_col: str | None = None
    """Event type column; its values map through ``types``."""
    types: dict[str, str] | None = None
    """Value of ``type_col`` → ``click`` or ``conversion``; other values are skipped (counted).
    None: the values ``click`` and ``conversion`` map to themselves."""
    rating_col: str | None = None
    min_rating: float | None = None
    """With ``rating_col``: rows rated below this are skipped (counted), not positives."""
    time_unit: str = "auto"
    """``auto`` (numbers: seconds or ms by size; other values: ISO 8601), ``s``, ``ms``,
    ``iso``."""
    delimiter: str | None = None
    """None: from the file's name, else sniffed from its first line."""
    encoding: str = "utf-8"
    header: bool | None = None
    """None: a first line that names the columns is a header; without one, columns are
    0-based positions (``user_col="0"``)."""
    clock_seed: int = 0
    """With no ``time_col``: the seed of ``synthetic_times``."""

    def __post_init__(self) -> None:
        if self.time_unit not in ("auto", "s", "ms", "iso"):
            raise LogError(f"time unit must be auto, s, ms or iso, not {self.time_unit!r}")
        for kind in (self.types or {}).values():
            if kind not in EVENT_TYPES:
                raise LogError(f"event types map to click or conversion, not {kind!r}")
        if self.min_rating is not None and self.rating_col is None:
            raise LogError("--min-rating needs --rating-col")


PRESETS: dict[str, LogFormat] = {
    # ratings.csv of MovieLens (latest, 20M, 25M): userId,movieId,rating,timestamp; the
    # header-less 100K (u.data, tab) and 1M (ratings.dat, ::) are read by position.
    "movielens": LogFormat("userId", "movieId", "timestamp", rating_col="rating"),
}
_MOVIELENS_POSITIONS = LogFormat("0", "1", "3", rating_col="2", header=False)


@dataclass
class BadRows:
    count: int = 0
    examples: list[tuple[int, str]] = field(default_factory=list)
    skipped: int = 0
    """Rows read well but not positives: a type not mapped, a rating below the bar."""

    def add(self, line: int, reason: str) -> None:
        self.count += 1
        if len(self.examples) < BAD_EXAMPLES:
            self.examples.append((line, reason))

    def summary(self) -> str:
        if not self.count:
            return "no bad rows"
        shown = "; ".join(f"line {n}: {why}" for n, why in self.examples)
        more = f" (first {len(self.examples)})" if self.count > len(self.examples) else ""
        return f"{self.count:,} bad rows{more}: {shown}"


@dataclass
class Interactions:
    """Positive interactions in event-time order (ties keep the file's order)."""

    users: np.ndarray
    """User id per interaction (str objects)."""
    items: np.ndarray
    t_ms: np.ndarray
    """Event time, ms since the epoch (int64)."""
    types: np.ndarray
    """``click`` or ``conversion`` per interaction."""
    lines: np.ndarray
    """The line each came from (1-based, the header included)."""
    bad: BadRows = field(default_factory=BadRows)
    source: str = ""

    def __len__(self) -> int:
        return len(self.users)

    def take(self, idx: np.ndarray | slice) -> Interactions:
        return Interactions(
            self.users[idx],
            self.items[idx],
            self.t_ms[idx],
            self.types[idx],
            self.lines[idx],
            self.bad,
            self.source,
        )


TIME_RANGE_MS = (-62_135_596_800_000, 253_402_300_799_999)
"""Times a log may hold: years 1 to 9999 (what ISO 8601 dates can say), in ms."""


def parse_time(raw: object, unit: str) -> int:
    """Milliseconds since the epoch from a cell; ValueError when it is not a time.

    >>> parse_time("1e19", "auto")
    Traceback (most recent call last):
    ...
    ValueError: time '1e19' is outside years 1 to 9999
    """
    t = _parse_time(raw, unit)
    if not TIME_RANGE_MS[0] <= t <= TIME_RANGE_MS[1]:
        raise ValueError(f"time {str(raw)[:40]!r} is outside years 1 to 9999")
    return t


def _parse_time(raw: object, unit: str) -> int:
    if isinstance(raw, bool) or raw is None:
        raise ValueError("no time")
    if unit != "iso":
        try:
            value = float(raw)
        except (TypeError, ValueError):
            if unit != "auto":
                raise ValueError(f"time {raw!r} is not a number") from None
        else:
            if not math.isfinite(value):
                raise ValueError(f"time {raw!r} is not finite")
            if not (unit == "ms" or (unit == "auto" and abs(value) >= MS_THRESHOLD)):
                value *= 1000  # 1e306 s is finite; in ms it is not
            if not math.isfinite(value):
                raise ValueError(f"time {str(raw)[:40]!r} is outside years 1 to 9999")
            return round(value)
    text = str(raw).strip()
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"time {text[:40]!r} is neither epoch seconds, ms nor ISO 8601") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1000)


def _cell(row: dict, col: str) -> str:
    value = row.get(col)
    if value is None:
        raise ValueError(f"no {col!r} column")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON 17.0: the id "17"
    return str(value).strip()


def _id(row: dict, col: str, what: str) -> str:
    value = _cell(row, col)
    if not value:
        raise ValueError(f"empty {what} id")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"{what} id longer than {MAX_ID_CHARS} characters")
    return value


def parse_rows(rows: Iterable[tuple[int, dict]], fmt: LogFormat, source: str = "") -> Interactions:
    """``Interactions`` from (line number, row) pairs; rows that cannot be read are counted
    in ``bad`` and left out. Raises ``LogError`` when no row is usable."""
    bad = BadRows()
    users: list[str] = []
    items: list[str] = []
    times: list[int] = []
    kinds: list[str] = []
    lines: list[int] = []
    types = fmt.types if fmt.types is not None else {t: t for t in EVENT_TYPES}
    for line, row in rows:
        try:
            if ROW_ERROR in row:
                raise ValueError(row[ROW_ERROR])
            user = _id(row, fmt.user_col, "user")
            item = _id(row, fmt.item_col, "item")
            t = parse_time(row.get(fmt.time_col), fmt.time_unit) if fmt.time_col else 0
            kind = "click"
            if fmt.type_col is not None:
                kind = types.get(_cell(row, fmt.type_col), "")
                if not kind:
                    bad.skipped += 1
                    continue
            if fmt.rating_col is not None:
                rating = float(_cell(row, fmt.rating_col))
                if not math.isfinite(rating):
                    raise ValueError("rating is not finite")
                if fmt.min_rating is not None and rating < fmt.min_rating:
                    bad.skipped += 1
                    continue
        except ValueError as exc:
            bad.add(line, str(exc))
            continue
        users.append(user)
        items.append(item)
        times.append(t)
        kinds.append(kind)
        lines.append(line)
    if not users:
        why = f"; {bad.summary()}" if bad.count else ""
        skipped = f"; {bad.skipped:,} rows skipped by type or rating" if bad.skipped else ""
        raise LogError(f"{source or 'the log'}: no usable interaction{why}{skipped}")
    t_ms = np.asarray(times, np.int64)
    if not fmt.time_col:
        t_ms = synthetic_times(users, fmt.clock_seed)
    order = np.argsort(t_ms, kind="stable")
    return Interactions(
        np.asarray(users, object)[order],
        np.asarray(items, object)[order],
        t_ms[order],
        np.asarray(kinds, object)[order],
        np.asarray(lines, np.int64)[order],
        bad,
        source,
    )


def synthetic_times(users: list[str], seed: int = 0) -> np.ndarray:
    """Times (ms) for a log that has none: each user's rows, in the order given, at sorted
    uniform random times over ``SYNTHETIC_SPAN_MS`` from ``SYNTHETIC_START_MS``, so a user's
    sequence is kept and users interleave. A split by time then cuts every user's sequence at
    about the same share (each user is seen before the cut and after it), which a log with
    real times does not do (its users come and go); what depends on real time (recent
    popularity, a trend) has no meaning on such a log.

    >>> synthetic_times(["a", "b", "a", "a"], seed=1).tolist()[::2] == sorted(
    ...     synthetic_times(["a", "b", "a", "a"], seed=1).tolist()[::2])
    True
    """
    n = len(users)
    _, codes = np.unique(np.asarray(users, object), return_inverse=True)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, SYNTHETIC_SPAN_MS, n, dtype=np.int64)
    by_value = np.lexsort((draws, codes))  # per user, its draws ascending
    by_file = np.lexsort((np.arange(n), codes))  # per user, its rows in file order
    t = np.empty(n, np.int64)
    t[by_file] = draws[by_value] + SYNTHETIC_START_MS
    return t


# ------------------------------------------------------------------------------ files


def _open_text(path: Path, encoding: str = "utf-8") -> io.TextIOBase:
    try:
        raw = path.open("rb")
    except OSError as exc:
        raise LogError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    stream = gzip.GzipFile(fileobj=raw) if head == b"\x1f\x8b" else raw
    # strict: a log in another encoding is reported (name it with ``encoding``), not misread
    try:
        return io.TextIOWrapper(stream, encoding=encoding, errors="strict", newline="")
    except LookupError:
        raw.close()
        raise LogError(f"unknown encoding {encoding!r}") from None


def _kind(path: Path) -> str:
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    return "delimited"


def _delimiter(path: Path, first: str, fmt: LogFormat) -> str:
    if fmt.delimiter:
        return fmt.delimiter
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".tsv", ".tab", ".inter")):
        return "\t"
    if name.endswith(".csv"):
        return ","
    for d in ("::", "\t", ",", ";", "|"):
        if d in first:
            return d
    return ","


def _split(line: str, delimiter: str) -> list[str]:
    if len(delimiter) > 1:
        return line.rstrip("\r\n").split(delimiter)
    return next(csv.reader([line], delimiter=delimiter))


def _looks_like_header(cells: list[str], fmt: LogFormat) -> bool:
    if fmt.header is not None:
        return fmt.header
    if fmt.user_col in cells or fmt.item_col in cells:
        return True
    return not any(c.strip().lstrip("-").replace(".", "", 1).isdigit() for c in cells)


def _delimited_rows(text: io.TextIOBase, path: Path, fmt: LogFormat) -> Iterator[tuple[int, dict]]:
    first = text.readline()
    if not first:
        raise LogError(f"{path}: the file is empty")
    delimiter = _delimiter(path, first, fmt)
    cells = _split(first, delimiter)
    header = _looks_like_header(cells, fmt)
    names = [c.strip() for c in cells] if header else [str(j) for j in range(len(cells))]
    wanted = tuple(c for c in (fmt.user_col, fmt.item_col, fmt.time_col) if c)
    if not header and not all(c.isdigit() for c in wanted):
        raise LogError(
            f"{path}: its first line is not a header: name the columns by position (0, 1, ...)"
        )
    if header:
        missing = [c for c in wanted if c not in names]
        if missing:
            raise LogError(
                f"{path}: no column {missing[0]!r} in its header ({', '.join(names[:12])})"
            )

    def numbered() -> Iterator[tuple[int, str]]:
        if not header:
            yield 1, first
        yield from enumerate(text, 2)

    for line_no, line in numbered():
        if not line.strip():
            continue
        try:
            values = _split(line, delimiter)
        except csv.Error as exc:
            yield line_no, {ROW_ERROR: str(exc)}
            continue
        yield line_no, dict(zip(names, values, strict=False))


def _jsonl_rows(text: io.TextIOBase) -> Iterator[tuple[int, dict]]:
    for line_no, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            yield line_no, {ROW_ERROR: "not JSON"}
            continue
        yield line_no, row if isinstance(row, dict) else {ROW_ERROR: "not a JSON object"}


def read_log(path: str | Path, fmt: LogFormat, limit: int | None = None) -> Interactions:
    """Read the interactions of the log at ``path`` (``limit``: at most that many rows)."""
    path = Path(path)
    if path.is_dir():
        raise LogError(f"{path}: is a directory, not a log file")
    text = _open_text(path, fmt.encoding)
    try:
        rows = _jsonl_rows(text) if _kind(path) == "jsonl" else _delimited_rows(text, path, fmt)
        if limit is not None:
            rows = (r for n, r in enumerate(rows) if n < limit)
        try:
            return parse_rows(rows, fmt, source=str(path))
        except UnicodeDecodeError as exc:
            raise LogError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise LogError(f"{path}: cannot be read ({exc})") from None
    finally:
        text.close()


def preset(name: str, path: str | Path | None = None) -> LogFormat:
    """The named format; ``movielens`` reads header-less files (u.data, ratings.dat) by
    column position."""
    try:
        fmt = PRESETS[name]
    except KeyError:
        raise LogError(f"unknown format {name!r} (known: {', '.join(PRESETS)})") from None
    if name == "movielens" and path is not None and not _has_header(Path(path), fmt):
        return _MOVIELENS_POSITIONS
    return fmt


def _has_header(path: Path, fmt: LogFormat) -> bool:
    text = _open_text(path, fmt.encoding)
    try:
        first = text.readline()
    except (UnicodeDecodeError, OSError, EOFError):
        return True  # read_log reports it
    finally:
        text.close()
    return _looks_like_header(_split(first, _delimiter(path, first, fmt)), replace(fmt))
