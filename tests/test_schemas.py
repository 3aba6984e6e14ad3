"""Wire contracts: schema files and records in step, every rejection reason, round trips."""

from __future__ import annotations

import dataclasses
import json
import types
import typing

import jsonschema
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import records
from schemas.codec import (
    CodecLimits,
    dead_letter,
    decode_dead_letter,
    decode_event,
    decode_item,
    decode_reply,
    decode_request,
    encode_dead_letter,
    encode_event,
    encode_item,
    encode_reply,
    encode_request,
)
from schemas.contract import SCHEMA_NAMES, Reason, Rejected, load_schema

NOW = 1_767_225_600_000
RECORD_FOR_SCHEMA = {
    "event": records.Event,
    "item": records.Item,
    "request": records.RecommendRequest,
    "reply": records.RecommendReply,
    "deadletter": records.DeadLetter,
    "control": records.ControlRecord,
}
NESTED = {
    ("request", "context"): records.RequestContext,
    ("reply", "items"): records.ReplyItem,
}


def _json_types(annotation) -> set[str]:
    """The JSON types a Python annotation allows (None excluded)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: set[str] = set()
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                out |= _json_types(arg)
        return out
    if origin is typing.Literal:
        return {"enum"}
    if origin in (tuple, list):
        return {"array"}
    if origin is dict:
        return {"object"}
    mapping = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in mapping:
        return {mapping[annotation]}
    if dataclasses.is_dataclass(annotation):
        return {"object"}
    raise AssertionError(f"unmapped annotation {annotation!r}")


def _schema_type(prop: dict) -> set[str]:
    if "enum" in prop:
        return {"enum"}
    if "const" in prop:
        return {"integer"}
    return {prop["type"]}


def _check_in_step(schema: dict, cls: type, where: str) -> None:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    props = schema["properties"]
    assert set(fields) == set(props), f"{where}: fields {set(fields) ^ set(props)} differ"
    required = {
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert required == set(schema.get("required", [])) - {"schema_version"}, where
    for name, prop in props.items():
        assert _json_types(hints[name]) == _schema_type(prop), f"{where}.{name}"
        if "enum" in prop:
            lit = [
                a for a in typing.get_args(hints[name]) if typing.get_origin(a) is typing.Literal
            ]
            values = typing.get_args(lit[0]) if lit else typing.get_args(hints[name])
            assert set(values) == set(prop["enum"]), f"{where}.{name} enum"


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_schema_files_are_valid_json_schema_and_match_records(name):
    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    _check_in_step(schema, RECORD_FOR_SCHEMA[name], name)
    for (schema_name, prop), cls in NESTED.items():
        if schema_name == name:
            sub = schema["properties"][prop]
            sub = sub.get("items", sub)
            _check_in_step(sub, cls, f"{name}.{prop}")


def event_doc(**over) -> dict:
    doc = {
        "schema_version": 1,
        "event_id": "e-1",
        "event_type": "click",
        "user_id": "u1",
        "item_id": "i1",
        "ts_ms": NOW,
        "region": "north",
        "device": "pc",
    }
    doc.update(over)
    return {k: v for k, v in doc.items() if v is not ...}


def raw(doc) -> bytes:
    return json.dumps(doc).encode()


REJECTIONS = [
    (b"{not json", Reason.MALFORMED_JSON),
    (b"\xff\xfe", Reason.MALFORMED_JSON),
    (b"[1, 2]", Reason.WRONG_TYPE),
    (raw(event_doc(ts_ms="soon")), Reason.WRONG_TYPE),
    (raw(event_doc(ts_ms=True)), Reason.WRONG_TYPE),
    (raw(event_doc(user_id=7)), Reason.WRONG_TYPE),
    (raw(event_doc(item_id=...)), Reason.MISSING_FIELD),
    (raw(event_doc(colour="red")), Reason.UNKNOWN_FIELD),
    (raw(event_doc(event_type="hover")), Reason.UNKNOWN_EVENT_TYPE),
    (raw(event_doc(schema_version=2)), Reason.UNSUPPORTED_SCHEMA_VERSION),
    (raw(event_doc(user_id="")), Reason.EMPTY_ID),
    (raw(event_doc(item_id="x" * 65)), Reason.ID_TOO_LONG),
    (raw(event_doc(ts_ms=946_684_799_999)), Reason.TIMESTAMP_TOO_OLD),
    (raw(event_doc(ts_ms=NOW + 3_600_000)), Reason.TIMESTAMP_IN_FUTURE),
    (raw(event_doc(device="fridge")), Reason.INVALID_VALUE),
    (raw(event_doc(value=-1.0)), Reason.INVALID_VALUE),
    (raw(event_doc(value=...)).replace(b"}", b', "value": NaN}'), Reason.NON_FINITE_NUMBER),
    (raw(event_doc()).replace(b"}", b', "value": Infinity}'), Reason.NON_FINITE_NUMBER),
    (raw(event_doc()).replace(b"}", b', "value": -Infinity}'), Reason.NON_FINITE_NUMBER),
    (raw(event_doc()).replace(b"}", b', "value": 1e400}'), Reason.NON_FINITE_NUMBER),
    (raw(event_doc(region="r" * 20_000)), Reason.OVERSIZE_PAYLOAD),
]


@pytest.mark.parametrize(("payload", "reason"), REJECTIONS, ids=[r for _, r in REJECTIONS])
def test_event_codec_rejects_with_machine_readable_reason(payload, reason):
    with pytest.raises(Rejected) as info:
        decode_event(payload, now_ms=NOW)
    assert info.value.reason == reason


# a request's headers, not a value: tests/test_serving_unit.py (route) and test_hostile_e2e.py
HEADER_REASONS = {
    Reason.REPLY_TO_NOT_ALLOWED,
    Reason.INVALID_CORRELATION_ID,
    Reason.DUPLICATE_HEADER,
    Reason.REPLY_UNDELIVERABLE,
}


def test_every_rejection_reason_is_exercised():
    assert {r for _, r in REJECTIONS} == set(Reason) - HEADER_REASONS


@pytest.mark.parametrize(("payload", "reason"), REJECTIONS[2:16])
def test_jsonschema_agrees_on_schema_level_rejections(payload, reason):
    doc = json.loads(payload)
    valid = jsonschema.Draft202012Validator(load_schema("event")).is_valid(doc)
    # future timestamps are a codec rule the schema cannot state
    assert valid == (reason == Reason.TIMESTAMP_IN_FUTURE)


def test_valid_events_round_trip_and_validate_against_the_schema():
    validator = jsonschema.Draft202012Validator(load_schema("event"))
    for doc in (
        event_doc(),
        event_doc(event_type="conversion", value=12.5, request_id="r1", position=3),
        event_doc(region=..., device=...),
    ):
        event = decode_event(raw(doc), now_ms=NOW)
        encoded = encode_event(event)
        validator.validate(json.loads(encoded))
        assert decode_event(encoded, now_ms=NOW) == event


def test_small_clock_skew_is_accepted_and_limits_are_settings():
    decode_event(raw(event_doc(ts_ms=NOW + 60_000)), now_ms=NOW)
    with pytest.raises(Rejected) as info:
        decode_event(raw(event_doc()), now_ms=NOW, limits=CodecLimits(max_payload_bytes=50))
    assert info.value.reason == Reason.OVERSIZE_PAYLOAD


def test_item_request_reply_round_trip():
    item = records.Item("i9", "c3", 19.99, NOW - 1000, region="east")
    assert decode_item(encode_item(item), NOW) == item
    req = records.RecommendRequest(
        "r1",
        "u1",
        k=5,
        context=records.RequestContext("low_end", "west", NOW),
        exclude=("i1", "i2"),
        deadline_ms=NOW + 100,
    )
    assert decode_request(encode_request(req), NOW) == req
    assert decode_request(b'{"schema_version":1,"request_id":"r","user_id":"u"}', NOW).k == 20
    reply = records.RecommendReply(
        "r1",
        "u1",
        (records.ReplyItem("i3", 0.75, ("vector", "hot")),),
        "full",
        "ok",
        NOW,
        model_version="m1",
        timings_ms={"total": 3.5},
    )
    decoded = decode_reply(encode_reply(reply), NOW)
    assert decoded == reply
    jsonschema.validate(json.loads(encode_reply(reply)), load_schema("reply"))


def test_request_k_bounds_and_exclusion_ids_are_checked():
    with pytest.raises(Rejected) as info:
        decode_request(b'{"schema_version":1,"request_id":"r","user_id":"u","k":0}', NOW)
    assert info.value.reason == Reason.INVALID_VALUE
    with pytest.raises(Rejected) as info:
        decode_request(b'{"schema_version":1,"request_id":"r","user_id":"u","exclude":[""]}', NOW)
    assert info.value.reason == Reason.EMPTY_ID


def test_dead_letter_envelope_keeps_reason_origin_and_original_bytes():
    bad = b'{"schema_version":1,"event_type":"hover"}'
    try:
        decode_event(bad, NOW)
    except Rejected as rej:
        letter = dead_letter(
            rej,
            topic="events",
            partition=3,
            offset=42,
            key=b"u1",
            value=bad,
            now_ms=NOW,
            service="test",
        )
    encoded = encode_dead_letter(letter)
    jsonschema.validate(json.loads(encoded), load_schema("deadletter"))
    back = decode_dead_letter(encoded, NOW)
    import base64

    assert back.reason == "missing_field"
    assert (back.source_topic, back.source_partition, back.source_offset) == ("events", 3, 42)
    assert base64.b64decode(back.value_b64) == bad
    assert base64.b64decode(back.key_b64) == b"u1"
    assert (back.value_bytes, back.value_truncated) == (len(bad), False)


def test_a_dead_letter_of_any_size_fits_the_broker_with_its_length_and_digest():
    """A rejected value of any size gives an envelope under the broker's 1 MB limit: the
    value cut to its first bytes, its full length and SHA-256 kept (and a huge key too)."""
    import base64
    import hashlib

    huge, key = bytes(range(256)) * 8000, b"k" * 100_000  # 2 MB of value, 100 kB of key
    letter = dead_letter(
        Rejected(Reason.OVERSIZE_PAYLOAD, "too big"),
        topic="events",
        partition=1,
        offset=2,
        key=key,
        value=huge,
        now_ms=NOW,
        service="test",
    )
    encoded = encode_dead_letter(letter)
    assert len(encoded) < 100_000
    back = decode_dead_letter(encoded, NOW)
    assert back.value_truncated and back.value_bytes == len(huge)
    assert back.value_sha256 == hashlib.sha256(huge).hexdigest()
    assert base64.b64decode(back.value_b64) == huge[:65_536]
    assert back.key_bytes == 100_000 and len(base64.b64decode(back.key_b64)) == 1024
    tomb = dead_letter(
        Rejected(Reason.MALFORMED_JSON, "empty value (tombstone)"),
        topic="events",
        partition=0,
        offset=0,
        key=None,
        value=None,
        now_ms=NOW,
        service="test",
    )
    back = decode_dead_letter(encode_dead_letter(tomb), NOW)
    assert back.value_null and back.value_bytes == 0 and back.key_b64 is None


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.fixed_dictionaries(
            {"mode": st.one_of(st.text(max_size=70), st.integers(), st.none())},
            optional={
                "at_ms": st.one_of(st.integers(-5, 2**64), st.floats(), st.booleans()),
                "by": st.one_of(st.text(max_size=210), st.integers()),
                "schema_version": st.integers(0, 3),
                "extra": st.integers(),
            },
        ).map(lambda d: json.dumps(d).encode()),
    )
)
def test_a_control_record_is_read_exactly_when_its_schema_accepts_it(data):
    """The worker's reading of the control topic agrees with control.schema.json on any
    bytes (unknown fields of a later version aside), and never raises."""
    from schemas.codec import decode_control, encode_control

    got = decode_control(data)
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    schema = load_schema("control")
    valid = isinstance(doc, dict) and jsonschema.Draft202012Validator(schema).is_valid(doc)
    assert (got is not None) == valid, (data, got)
    if got is not None:
        assert decode_control(encode_control(got)) == got


def test_reply_encoder_writes_every_field():
    import dataclasses
    import json

    from schemas.codec import encode_reply
    from schemas.records import RecommendReply, ReplyItem

    reply = RecommendReply(
        request_id="r",
        user_id="u",
        items=(ReplyItem("i", 0.5, ("vector",)),),
        tier="full",
        tier_reason="ok",
        served_at_ms=1_767_225_600_000,
        degraded=True,
        model_version="m",
        user_embedding_version=3,
        user_embedding_age_ms=4,
        item_table_version=5,
        timings_ms={"total": 1.0},
        worker="w",
        experiment="e",
        variant="v",
        ranker="attention",
        mode="promo",
    )
    encoded = json.loads(encode_reply(reply))
    assert set(encoded) == {f.name for f in dataclasses.fields(RecommendReply)}
    assert decode_reply(encode_reply(reply), 1_767_225_600_000) == reply
    # the same bytes as the standard library's compact encoding
    assert encode_reply(reply) == json.dumps(encoded, separators=(",", ":")).encode()
    for bad in (
        dataclasses.replace(reply, items=(ReplyItem("i", float("nan"), ("vector",)),)),
        dataclasses.replace(reply, timings_ms={"total": float("inf")}),
    ):
        with pytest.raises(ValueError, match="finite"):
            encode_reply(bad)


def _mutations(rng, obj: dict) -> dict:
    """``obj`` with one field swapped for an edge value of some JSON type (or removed/added)."""
    edge = [
        None,
        True,
        False,
        0,
        -1,
        1,
        1.0,
        -0.0,
        1.5,
        2**63,
        -(2**63),
        2**64,
        10**30,
        1e308,
        "",
        "x",
        "x" * 65,
        "x" * 129,
        "click",
        "impression",
        "high_end",
        [],
        {},
        [1],
        {"a": 1},
        946_684_800_000,
        946_684_799_999,
        NOW + 600_000,
        NOW + 600_001,
    ]
    out = dict(obj)
    key = rng.choice([*out, "extra"])
    roll = rng.random()
    if roll < 0.1:
        out.pop(key, None)
    else:
        out[key] = edge[rng.integers(len(edge))]
    return out


@pytest.mark.parametrize("name", ["event", "item", "request"])
def test_fast_path_accepts_only_what_the_strict_path_accepts_with_equal_values(name):
    """The orjson + generated-acceptor fast path never passes a record the strict path
    rejects, and what it passes decodes to the same values (JSON-level edge cases included:
    big integers, NaN, lone surrogates, duplicate keys)."""
    from schemas.codec import _acceptor, _checker, parse_json

    event = records.Event("e1", "click", "u1", "i1", NOW, "r", "pc", "q", 3, 2.5)
    item = records.Item("i1", "c1", 9.5, NOW, "r", "t")
    context = records.RequestContext("pc", "r", NOW)
    request = records.RecommendRequest("q1", "u1", 10, context, ("i1",), NOW + 50)
    encoded = {
        "event": encode_event(event),
        "item": encode_item(item),
        "request": encode_request(request),
    }
    base = json.loads(encoded[name])
    check = _checker(name)
    accept = _acceptor(name)
    raw_cases = [
        b'{"a":NaN}',
        b"[1e400]",
        b'{"ts_ms":123456789012345678901234567890}',
        b'"\\ud800"',
        b"\xef\xbb\xbf{}",
    ]
    rng = np.random.default_rng(7)
    cases = [json.dumps(_mutations(rng, base)).encode() for _ in range(3000)]
    cases += [json.dumps(base).encode(), *raw_cases]
    cases += [c.replace(b'"u1"', b'"u1","user_id":"u2"', 1) for c in cases[:50]]  # dup keys
    fast_passed = 0
    for data in cases:
        try:
            fast = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if not accept(fast, NOW + 600_000):
            continue
        fast_passed += 1
        strict = parse_json(data)  # must not raise
        check(strict, NOW + 600_000)  # must not raise
        assert fast == strict and [type(v) for v in fast.values()] == [
            type(v) for v in strict.values()
        ], data
    assert fast_passed > 100  # the fast path is exercised, not just skipped


def test_batch_event_decode_agrees_with_decode_event_on_every_value():
    """``decode_events`` (the C struct path) gives, value by value, what ``decode_event``
    gives: the same field values for a record it passes, the same reason for one it
    rejects — on mutated events, JSON edge cases and explicit nulls (which the struct
    alone would let through for optional fields)."""

    from schemas.codec import decode_event, decode_events

    event = records.Event("e1", "click", "u1", "i1", NOW, "r", "pc", "q", 3, 2.5)
    base = json.loads(encode_event(event))
    rng = np.random.default_rng(11)
    cases: list = [json.dumps(_mutations(rng, base)).encode() for _ in range(3000)]
    cases += [
        encode_event(event),
        None,
        b"",
        b"{}",
        b"[]",
        b'{"a":NaN}',
        b'"\\ud800"',
        b"\xff{",
        encode_event(event).replace(b'"u1"', b'"u\\ud800"'),
        encode_event(event) + b" ",
        encode_event(event).replace(b'"region":"r"', b'"region":null'),
        encode_event(event).replace(b"2.5", b"1e400"),
        encode_event(event).replace(b"2.5", b"123456789012345678901234567890"),
        encode_event(event).replace(b'"ts_ms":', b'"ts_ms":1.0,"ts_ms":'),
        b"x" * 20_000,
    ]
    got = decode_events(cases, NOW)
    assert len(got) == len(cases)
    passed = 0
    for data, fast in zip(cases, got, strict=True):
        try:
            want = decode_event(data, NOW)
        except Rejected as rej:
            assert isinstance(fast, Rejected) and fast.reason == rej.reason, (data, fast)
            continue
        passed += 1
        assert not isinstance(fast, Rejected), (data, fast)
        for f in dataclasses.fields(records.Event):
            assert getattr(fast, f.name) == getattr(want, f.name), (data, f.name)
    assert passed > 100


def test_batch_event_decode_of_clean_batches_with_one_bad_value_each():
    """The whole-batch path of ``decode_events`` (taken when every value passes) is only
    taken then: one bad value among good ones gives that value's reason and the others'
    records, whatever the fault, including a value of an event time too far ahead."""
    from schemas.codec import decode_event, decode_events

    good = [encode_event(records.Event(f"e{i}", "click", "u1", "i1", NOW - i)) for i in range(6)]
    ahead = encode_event(records.Event("late", "click", "u1", "i1", NOW + 11 * 60_000))
    bad = [
        None,
        b"",
        b"{}",
        b"[]",
        b'{"a":NaN}',
        b"x" * 20_000,
        ahead,
        good[0].replace(b'"i1"', b"null"),
        good[0].replace(b'"click"', b'"clack"'),
    ]
    whole = decode_events(good, NOW)
    assert [e.event_id for e in whole] == [f"e{i}" for i in range(6)]
    for value in bad:
        got = decode_events([*good[:3], value, *good[3:]], NOW)
        assert isinstance(got[3], Rejected), value
        with pytest.raises(Rejected) as want:
            decode_event(value, NOW)
        assert got[3].reason == want.value.reason
        assert [e.event_id for e in got[:3] + got[4:]] == [f"e{i}" for i in range(6)]


def test_struct_compiler_takes_flat_schemas_and_declines_the_rest():
    import msgspec

    from schemas.contract import compile_struct, load_schema

    event, stamps = compile_struct(load_schema("event"), "E")
    assert stamps == ("ts_ms",)
    data = encode_event(records.Event("e1", "click", "u1", "i1", NOW))
    assert msgspec.json.decode(data, type=event).user_id == "u1"
    with_region = encode_event(records.Event("e1", "click", "u1", "i1", NOW, region="r"))
    assert msgspec.json.decode(data, type=event).region is None  # absent: None
    for bad in (
        data.replace(b"}", b',"extra":1}'),
        data.replace(b'"u1"', b'""'),
        with_region.replace(b'"r"', b"null"),  # an optional property's explicit null
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=event)
    assert compile_struct(load_schema("item"), "I") is not None
    assert compile_struct(load_schema("request"), "R") is None  # nested context, exclude list
    assert compile_struct({"type": "object", "properties": {"a": {"type": "integer"}}}, "X") is None
