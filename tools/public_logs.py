"""Public interaction logs whose files ``freshrec replay`` cannot read as they are, turned into
the CSV it reads (``user_id,item_id,timestamp``, epoch seconds). Where to get each file, and
the command to replay it: ``docs/replay.md``, "Public logs to try". Nothing is downloaded.

    python -m tools.public_logs ticoserec Beauty_item_org_rank.txt Beauty_time_org_rank.txt beauty.csv
    python -m tools.public_logs diginetica sample_train-item-views.csv diginetica.csv
    python -m tools.public_logs sessions yoochoose-clicks-100k_train_full.txt \\
        yoochoose-clicks-100k_test.txt yoochoose.csv

- ``ticoserec``: two parallel files, one line per user: ``user item1 item2 …`` and ``user t1
  t2 …`` (epoch seconds), as the TiCoSeRec repository ships Amazon Beauty and Yelp with times.
- ``diginetica``: the CIKM Cup 2016 item views (``session_id;user_id;item_id;timeframe;
  eventdate``): the time is the day (UTC) plus ``timeframe`` milliseconds, as session-rec's
  preprocessing reads it; the session is the user.
- ``sessions``: tab-separated ``SessionId ItemId Time`` files (session-rec's prepared
  YooChoose), concatenated in the order given; the session is the user.

Rows keep their files' order (the replay sorts by time, keeping that order among equal times).
"""

from __future__ import annotations

import argparse
import calendar
import csv
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HEADER = ["user_id", "item_id", "timestamp"]


class LogFormatError(ValueError):
    """A file is not what its format says; the message names the line."""


def ticoserec(items: Path, times: Path) -> Iterator[list]:
    """Rows of two parallel sequence files.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> _ = Path(d, "i").write_text("1 7 8\\n2 9\\n"); _ = Path(d, "t").write_text("1 10 20\\n2 30\\n")
    >>> list(ticoserec(Path(d, "i"), Path(d, "t")))
    [['1', '7', 10], ['1', '8', 20], ['2', '9', 30]]
    """
    with items.open() as fi, times.open() as ft:
        for lineno, (li, lt) in enumerate(zip(fi, ft, strict=False), 1):
            a, b = li.split(), lt.split()
            if not a or a[0] != b[0] or len(a) != len(b):
                raise LogFormatError(f"{items}:{lineno}: the item and time lines disagree")
            for item, t in zip(a[1:], b[1:], strict=True):
                yield [a[0], item, int(t)]
        if fi.readline() or ft.readline():
            raise LogFormatError(f"{items} and {times} have different numbers of lines")


def diginetica(views: Path) -> Iterator[list]:
    """Rows of the item views: the session as the user, the day plus ``timeframe`` ms."""
    with views.open(newline="") as f:
        for row in csv.DictReader(f, delimiter=";"):
            day = calendar.timegm(time.strptime(row["eventdate"], "%Y-%m-%d"))
            yield [row["session_id"], row["item_id"], round(day + int(row["timeframe"]) / 1000, 3)]


def sessions(*paths: Path) -> Iterator[list]:
    """Rows of tab-separated ``SessionId ItemId Time`` files, in the order given."""
    for path in paths:
        with path.open(newline="") as f:
            rows = csv.reader(f, delimiter="\t")
            if next(rows, None) != ["SessionId", "ItemId", "Time"]:
                raise LogFormatError(f"{path}: expected the header SessionId, ItemId, Time")
            for session, item, t in rows:
                yield [session, item, t]


def write(rows: Iterator[list], out: Path) -> int:
    n = 0
    with out.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(HEADER)
        for row in rows:
            w.writerow(row)
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="format", required=True)
    t = sub.add_parser("ticoserec", help="parallel item and time sequence files")
    t.add_argument("items", type=Path)
    t.add_argument("times", type=Path)
    d = sub.add_parser("diginetica", help="CIKM Cup 2016 item views")
    d.add_argument("views", type=Path)
    s = sub.add_parser("sessions", help="SessionId/ItemId/Time files")
    s.add_argument("files", type=Path, nargs="+")
    for p in (t, d, s):
        p.add_argument("out", type=Path, help="the CSV to write")
    args = parser.parse_args(argv)
    if args.format == "ticoserec":
        rows = ticoserec(args.items, args.times)
    elif args.format == "diginetica":
        rows = diginetica(args.views)
    else:
        rows = sessions(*args.files)
    try:
        n = write(rows, args.out)
    except (OSError, LogFormatError, KeyError, ValueError) as exc:
        print(f"public_logs: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n:,} interactions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
