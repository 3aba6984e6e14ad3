"""Property-based fuzzing of every public input, in-process: the topics' records (events,
items, requests, gradient and update batches), the experiments file, interaction-log rows,
model manifests and the CLI's arguments.

Each property runs a few hundred generated cases per run from a fresh seed (Hypothesis'
default; a failure prints the seed, ``--hypothesis-seed=N`` replays it, and the
``@reproduce_failure`` blob pins the case). The strategies mix garbage with valid-but-extreme
values: ids at their length limits in multi-byte UTF-8 and one past, times at the edges of
what JSON and int64 hold, batches at their size limits. Every input gets a value or the
module's own error (a ``FreshRecError``): never another exception. ``tests/test_fuzz_e2e.py``
sends such records through a running worker and streams app.
"""

from __future__ import annotations

import json
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.errors import FreshRecError

NOW_MS = 1_767_225_600_000
CASES = settings(
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- the values
CHARS = st.characters(codec="utf-8", exclude_categories=("Cs",))
WIDE = st.sampled_from(["😀", "中", "é", "\u0000", "\u200b", "a", " ", "\U0010ffff"])


def ids(limit: int) -> st.SearchStrategy[str]:
    """Ids of any length up to one past ``limit`` characters, often exactly at it, often
    in characters of four UTF-8 bytes."""
    return st.one_of(
        st.text(CHARS, min_size=0, max_size=limit + 1),
        st.integers(limit - 1, limit + 1).flatmap(
            lambda n: st.lists(WIDE, min_size=n, max_size=n).map("".join)
        ),
    )


EDGE_INTS = st.sampled_from(
    [0, -1, 1, 2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**64)]
)
TIMES = st.one_of(
    EDGE_INTS,
    st.integers(NOW_MS - 10**12, NOW_MS + 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.just(1e19),
    st.just(NOW_MS + 0.5),
)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    EDGE_INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(CHARS, max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def documents(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """A record with each field valid, extreme, retyped or absent."""
    return st.fixed_dictionaries(
        {},
        optional={name: st.one_of(valid, valid, JUNK) for name, valid in fields.items()},
    )


EVENT = {
    "schema_version": st.sampled_from([1, 1, 2, 0]),
    "event_id": ids(128),
    "event_type": st.sampled_from(["click", "impression", "conversion", "view", ""]),
    "user_id": ids(64),
    "item_id": ids(64),
    "ts_ms": TIMES,
    "request_id": ids(128),
    "region": ids(32),
    "device": st.sampled_from(["pc", "mobile", "high_end", "toaster"]),
}
ITEM = {
    "schema_version": st.sampled_from([1, 1, 2]),
    "item_id": ids(64),
    "category": ids(64),
    "price": st.one_of(st.floats(allow_nan=False), EDGE_INTS),
    "created_ms": TIMES,
}
REQUEST = {
    "schema_version": st.sampled_from([1, 1, 2]),
    "request_id": ids(128),
    "user_id": ids(64),
    "k": st.one_of(st.integers(-5, 1000), EDGE_INTS),
    "exclude": st.lists(ids(64), max_size=5),
    "context": st.fixed_dictionaries(
        {}, optional={"device": st.sampled_from(["pc", "x"]), "region": ids(32), "ts_ms": TIMES}
    ),
    "deadline_ms": TIMES,
}


def encoded(doc: dict) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass")


def values(fields: dict) -> st.SearchStrategy[bytes]:
    return st.one_of(
        documents(fields).map(encoded),
        documents(fields).map(encoded),
        st.binary(max_size=200),
        st.just(b"{" * 5000),
        st.just(b"[" * 100_000),
        st.just(b'{"schema_version": 1e999}'),
        st.just(b'{"ts_ms": NaN}'),
    )


# --------------------------------------------------------------------------- the records


@CASES
@given(st.lists(values(EVENT), min_size=1, max_size=8))
def test_events_decode_alike_on_the_fast_and_the_strict_path_and_only_reject(batch):
    """``decode_events`` (the C fast path) and ``decode_event`` (the strict path) accept and
    reject the same values, for the same reasons."""
    from schemas.codec import decode_event, decode_events
    from schemas.contract import Rejected

    fast = decode_events(batch, NOW_MS)
    assert len(fast) == len(batch)
    for value, got in zip(batch, fast, strict=True):
        try:
            strict = decode_event(value, NOW_MS)
        except Rejected as rej:
            assert isinstance(got, Rejected), (value, got)
            assert got.reason == rej.reason, (value, got, rej)
            continue
        assert not isinstance(got, Rejected), (value, got)
        assert got.event_id == strict.event_id and got.ts_ms == strict.ts_ms
        assert got.user_id == strict.user_id and got.item_id == strict.item_id


CODECS = {"item": ITEM, "request": REQUEST}


@pytest.mark.parametrize("kind", sorted(CODECS))
@CASES
@given(data=st.data())
def test_items_and_requests_decode_or_are_rejected(kind, data):
    """What is accepted round-trips through its encoder; the rest is ``Rejected``."""
    from schemas import codec
    from schemas.contract import Rejected

    decode, encode = getattr(codec, f"decode_{kind}"), getattr(codec, f"encode_{kind}")
    value = data.draw(values(CODECS[kind]))
    try:
        record = decode(value, NOW_MS)
    except Rejected:
        return
    assert decode(encode(record), NOW_MS) == record


@st.composite
def row_batches(draw):
    from schemas.rowbatch import KIND_GRADIENTS, KIND_UPDATES, MAX_DIM, RowBatch

    n = draw(st.integers(0, 40))
    dim = draw(st.sampled_from([1, 2, 8, 64, MAX_DIM]))
    if n * dim > 200_000:
        n = 200_000 // dim
    rows = np.random.default_rng(draw(st.integers(0, 2**32))).standard_normal(n * dim)
    rows = rows.astype(np.float32)
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    for at, value in draw(st.lists(st.tuples(st.integers(0, 10**6), floats), max_size=8)):
        if n * dim:
            rows[at % (n * dim)] = value  # NaN, infinities, subnormals among the rows
    return RowBatch(
        draw(st.sampled_from([KIND_GRADIENTS, KIND_UPDATES])),
        draw(st.sampled_from([0, 1])),
        np.array(draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))),
        rows.reshape(n, dim),
        np.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)), np.uint64),
        np.array(draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))),
        partition=draw(st.integers(-1, 2**31 - 1)),
        offset=draw(st.integers(-1, 2**63 - 1)),
    )


@CASES
@given(row_batches(), st.data())
def test_row_batches_round_trip_and_any_changed_byte_is_refused(batch, data):
    """Gradient and update batches (any dimension up to the limit, any ids, versions and
    times, NaN rows included: the worker refuses those after decoding), float32 or float16
    rows: a batch decodes to itself (its rows rounded to float16 in the half layout); a
    changed byte, a cut or any other bytes raise ``CorruptBatch``."""
    from schemas.rowbatch import CorruptBatch, RowBatch

    half = data.draw(st.booleans())  # float16 rows (layout 3) where they fit
    raw = batch.encode(half=half)
    back = RowBatch.decode(raw)
    assert back.ids.tolist() == batch.ids.tolist() and back.dim == batch.dim
    want = batch.rows
    if half and batch.fits_half():
        want = batch.rows.astype(np.float16).astype(np.float32)
    assert np.array_equal(back.rows, want, equal_nan=True)
    at = data.draw(st.integers(0, len(raw) - 1))
    flipped = bytearray(raw)
    flipped[at] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(raw) - 1))
    for bad in (bytes(flipped), raw[:cut], data.draw(st.binary(max_size=300))):
        with pytest.raises(CorruptBatch):
            RowBatch.decode(bad)


@CASES
@given(
    st.integers(0, 65535),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 65535),
    st.integers(0, 2**32 - 1),
)
def test_a_header_that_lies_about_its_sizes_is_refused_not_trusted(
    version, kind, table, dim, count
):
    """A header with a valid checksum whose version, kind, table, dimension or count is out
    of range or disagrees with the body: refused before any allocation of its size."""
    from schemas.rowbatch import MAGIC, CorruptBatch, RowBatch

    head = struct.pack("<4sHBBHHIiqq", MAGIC, version, kind, table, dim, 0, count, -1, -1, 0)
    body = b"\0" * 64
    raw = head + body + struct.pack("<I", zlib.crc32(head + body))
    try:
        batch = RowBatch.decode(raw)
    except CorruptBatch:
        return
    assert len(batch) * (batch.dim * 4 + 32) <= len(body)


# --------------------------------------------------------------------------- the files

TOML_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.booleans(),
    st.text(CHARS, max_size=70),
    st.lists(st.integers(), max_size=3),
)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(v), repr(v))
    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v) if isinstance(v, list) else str(v)


@st.composite
def experiment_files(draw) -> str:
    keys = ["name", "share", "ranking", "mmr_lambda", "exclude_seen", "recall_quotas"]
    keys += ["head_share", "mid_share", "nope"]
    good = {
        "name": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,70}", fullmatch=True),
        "share": st.floats(-1, 2),
        "ranking": st.sampled_from(["wide_deep", "light", "attention", "pruned", "nope"]),
        "mmr_lambda": st.floats(-1, 2),
        "exclude_seen": st.booleans(),
        "head_share": st.floats(-1, 2),
        "mid_share": st.floats(-1, 2),
    }
    lines = []
    for key in draw(st.lists(st.sampled_from(["name", "salt", "control", "x"]), max_size=4)):
        lines.append(f"{key} = {toml_value(draw(st.one_of(ids(64), TOML_VALUES)))}")
    for _ in range(draw(st.integers(0, 6))):
        lines.append("[[variant]]")
        for key in draw(st.lists(st.sampled_from(keys), max_size=6, unique=True)):
            if key == "recall_quotas":
                channel = draw(st.sampled_from(["vector", "hot", "covisit", "x"]))
                quota = draw(st.one_of(st.integers(-5, 10**6), st.floats()))
                lines.append(f"recall_quotas = {{ {channel} = {toml_value(quota)} }}")
                continue
            value = draw(st.one_of(good.get(key, TOML_VALUES), TOML_VALUES))
            lines.append(f"{key} = {toml_value(value)}")
    if draw(st.booleans()):
        lines.append(draw(st.sampled_from(["variant = [1, 2]", "x = " + "[" * 2000, "[["])))
    return "\n".join(lines)


@CASES
@given(st.one_of(experiment_files(), st.text(CHARS, max_size=200)))
def test_an_experiments_file_parses_or_says_what_is_wrong(text):
    from inference.serving.experiments import ExperimentError, allocate, parse

    try:
        exp = parse(text)
    except ExperimentError as err:
        assert "experiments.toml" in str(err)
        return
    table = allocate(None, [], exp)
    assert table and max(table) < len(exp.variants)


ROW_FIELDS = st.one_of(
    st.text(CHARS, max_size=70),
    st.sampled_from(["", "1e19", "-1e19", "nan", "inf", "9" * 30, "2026-13-45T99:99:99Z", "0x1f"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(str),
)


@CASES
@given(
    st.lists(
        st.fixed_dictionaries(
            {}, optional={k: ROW_FIELDS for k in ("user_id", "item_id", "timestamp", "rating")}
        ),
        max_size=20,
    ),
    st.sampled_from(["auto", "s", "ms", "iso"]),
)
def test_interaction_log_rows_are_read_or_counted_bad(rows, unit):
    """Any cells in any column: the log reader returns what it could read (bad rows counted)
    or ``LogError`` when nothing is usable — no traceback."""
    from inference.training.interactions import LogError, LogFormat, parse_rows

    fmt = LogFormat(time_unit=unit, rating_col="rating", min_rating=3.0)
    try:
        inter = parse_rows(enumerate(rows, 1), fmt, "fuzz.csv")
    except LogError:
        return
    assert 0 < len(inter) <= len(rows)


@CASES
@given(
    st.one_of(
        st.binary(max_size=100),
        st.recursive(JUNK, lambda c: st.lists(c, max_size=3), max_leaves=5).map(encoded),
        st.fixed_dictionaries(
            {}, optional={"version": JUNK, "dim": JUNK, "files": JUNK, "online": JUNK}
        ).map(encoded),
    )
)
def test_a_model_manifest_is_read_or_refused_with_its_path(raw):
    from inference.models.modelfile import MANIFEST, ModelFileError, read_manifest

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / MANIFEST).write_bytes(raw)
        try:
            manifest = read_manifest(Path(d))
        except ModelFileError as err:
            assert MANIFEST in str(err)
            return
        assert isinstance(manifest, dict) and isinstance(manifest["files"], dict)


# --------------------------------------------------------------------------- the CLI

COMMANDS = ["run", "replay", "train", "serve", "streams", "param-server", "experiments", "top"]
TOKENS = st.one_of(
    st.sampled_from(COMMANDS),
    st.sampled_from(["--duration", "--rate", "--requests", "--items", "-k", "--tune", "--set"]),
    st.sampled_from(["-1", "0", "nan", "inf", "1e309", "", "--", "x=1,", "=", "1" * 400]),
    st.text(CHARS, max_size=20),
)


@CASES
@given(st.lists(TOKENS, max_size=6))
def test_the_cli_parses_any_arguments_or_exits_with_usage(argv):
    """Any argument list: a namespace for a command, or argparse's usage error (exit 2);
    parsing alone runs nothing."""
    from freshrec.app.cli import build_parser

    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        assert exc.code in (0, 2), (argv, exc.code)


def test_every_fuzzed_error_is_a_freshrec_error():
    """The errors the properties above allow are the project's own."""
    from inference.models.modelfile import ModelFileError
    from inference.serving.experiments import ExperimentError
    from inference.training.interactions import LogError
    from schemas.contract import Rejected
    from schemas.rowbatch import CorruptBatch

    for err in (Rejected, CorruptBatch, ExperimentError, LogError, ModelFileError):
        assert issubclass(err, FreshRecError), err
