"""The event vocabulary: golden samples, codec round trips, unknown kinds, versions, registration."""

from __future__ import annotations

import datetime as dt
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from riverbed import events

GOLDEN = Path(__file__).parent / "golden" / "events.jsonl"


def golden_lines() -> list[bytes]:
    return [line for line in GOLDEN.read_bytes().splitlines() if line.strip()]


# --- kinds used only by these tests (tags are permanent, so they carry a test_ prefix) ---------


@events.register
class Greeting(events.Action, frozen=True, kw_only=True, tag="test_greeting"):
    """Version 2 renamed ``who`` (v1) to ``name`` and added ``polite``."""

    version: ClassVar[int] = 2

    v: int = 2
    name: str
    polite: bool = True


@events.upcaster("test_greeting", 1)
def _greeting_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    raw["name"] = raw.pop("who")
    raw["polite"] = False
    return raw


@events.register
class Deploy(events.Action, frozen=True, kw_only=True, tag="test_deploy"):
    service: str
    replicas: int = 1


# --- golden samples ---------------------------------------------------------------------------


def test_golden_samples_cover_every_builtin_kind() -> None:
    decoded = [events.decode_json(line) for line in golden_lines()]
    seen = {type(e) for e in decoded}
    builtin = {cls for kind, cls in events.kinds().items() if not kind.startswith("test_")}
    assert builtin <= seen, f"no golden sample for {sorted(c.__name__ for c in builtin - seen)}"


@pytest.mark.parametrize("line", golden_lines(), ids=lambda line: msgspec.json.decode(line)["kind"])
def test_golden_sample_round_trips(line: bytes) -> None:
    raw = msgspec.json.decode(line)
    event = events.decode_json(line)
    assert event.id == raw["id"]
    # Every field of the sample survives (new fields with defaults may be added later).
    again = msgspec.json.decode(events.encode_json(event))
    assert {k: again.get(k) for k in raw} == raw
    # msgpack (the stream form) keeps everything but the id, which is the entry id.
    payload = events.encode(event)
    assert msgspec.msgpack.decode(payload).get("id") is None
    back = events.decode(payload, event.id)
    assert back == event
    assert events.encode_json(back) == events.encode_json(event)
    # JSON without the id.
    assert events.decode_json(events.encode_json(event), keep_id=False) == msgspec.structs.replace(event, id=None)


def test_golden_unknown_kind_keeps_its_payload() -> None:
    (line,) = [line for line in golden_lines() if b'"kind":"teleport"' in line]
    event = events.decode_json(line)
    assert isinstance(event, events.Unknown)
    assert event.original_kind == "teleport"
    assert event.payload["destination"] == "mars"
    assert "id" not in event.payload
    # The envelope is read from the payload, so logs and views place it correctly.
    assert (event.id, event.source, event.tenant) == (24, "agent", "acme")
    assert event.ts == dt.datetime(2026, 11, 2, 9, 2, tzinfo=dt.UTC)
    assert events.encode_json(event) == line


# --- property round trips ---------------------------------------------------------------------

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
_TEXT = st.text(max_size=20)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | _INT64 | _FLOATS | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_UTC_TIMES = st.datetimes(
    min_value=dt.datetime(1971, 1, 1), max_value=dt.datetime(2200, 1, 1), timezones=st.just(dt.UTC)
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """Values of a field type that both wire forms can carry exactly."""
    if tp is Any:
        return _JSON_VALUES
    if tp is dt.datetime:
        return _UTC_TIMES
    if tp is float:
        return _FLOATS
    if tp is int:
        return _INT64
    if tp is str:
        return _TEXT
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return bounded(args[0], *[m for m in args[1:] if isinstance(m, msgspec.Meta)])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[strategy_for(a) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=3)
    if origin is tuple:
        return st.tuples(*[strategy_for(a) for a in args])
    if origin is dict:
        return st.dictionaries(_TEXT, strategy_for(args[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_strategy(tp)
    return st.from_type(tp)


def bounded(tp: Any, *metas: msgspec.Meta) -> st.SearchStrategy[Any]:
    """Values of a number type within the bounds its schema states, and strings of its pattern
    (``msgspec.Meta``)."""
    low = max([m.ge for m in metas if m.ge is not None] + [m.gt for m in metas if m.gt is not None], default=None)
    high = min([m.le for m in metas if m.le is not None], default=None)
    exclude_low = any(m.gt is not None for m in metas)
    if tp is float:
        return st.floats(low, high, allow_nan=False, allow_infinity=False, exclude_min=exclude_low)
    if tp is int:
        low = -(2**63) if low is None else int(low) + (1 if exclude_low else 0)
        return st.integers(low, 2**63 - 1 if high is None else int(high))
    pattern = next((m.pattern for m in metas if m.pattern is not None), None)
    if tp is str and pattern is not None:
        return st.from_regex(pattern, fullmatch=True)
    return strategy_for(tp)


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    fields = {f.name: strategy_for(f.type) for f in msgspec.structs.fields(cls)}
    if issubclass(cls, events.Event):
        fields["v"] = st.just(cls.version)
        fields["id"] = st.none() | st.integers(min_value=1, max_value=2**53)
    return st.builds(cls, **fields)


_ROUND_TRIP_KINDS = sorted(kind for kind, cls in events.kinds().items() if cls is not events.Unknown)


@pytest.mark.parametrize("kind", _ROUND_TRIP_KINDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_kind_round_trips_through_msgpack_and_json(kind: str, data: st.DataObject) -> None:
    event = data.draw(struct_strategy(events.kinds()[kind]))
    assert event.kind == kind
    back = events.decode(events.encode(event), event.id)
    assert back == event
    assert events.decode_json(events.encode_json(event)) == event
    assert events.from_builtins(events.to_builtins(event)) == event


@settings(max_examples=60, deadline=None)
@given(
    kind=st.text(min_size=1, max_size=12).filter(lambda k: k not in events.kinds()),
    extra=st.dictionaries(st.text(max_size=8).filter(lambda k: k not in ("kind", "id")), _JSON_VALUES, max_size=4),
)
def test_unknown_kinds_keep_their_raw_payload_and_never_raise(kind: str, extra: dict[str, Any]) -> None:
    raw = {"kind": kind, **extra}
    event = events.decode(msgspec.msgpack.encode(raw), 7)
    assert isinstance(event, events.Unknown)
    assert event.id == 7
    assert event.original_kind == kind
    assert event.payload == raw
    assert msgspec.msgpack.decode(events.encode(event)) == raw
    from_json = events.decode_json(events.encode_json(event))
    assert isinstance(from_json, events.Unknown)
    assert from_json.payload == raw
    assert from_json.id == 7


def test_a_payload_without_kind_is_unknown_not_an_error() -> None:
    event = events.decode(msgspec.msgpack.encode({"hello": "world"}), 3)
    assert isinstance(event, events.Unknown)
    assert event.payload == {"hello": "world"}


# --- versions ---------------------------------------------------------------------------------


def test_an_old_version_is_upcast_on_read() -> None:
    v1 = msgspec.msgpack.encode({"kind": "test_greeting", "v": 1, "source": "user", "who": "ann"})
    event = events.decode(v1, 5)
    assert isinstance(event, Greeting)
    assert (event.id, event.name, event.polite, event.v, event.source) == (5, "ann", False, 2, "user")
    from_json = events.decode_json(b'{"kind":"test_greeting","v":1,"who":"bob","id":9}')
    assert isinstance(from_json, Greeting)
    assert (from_json.id, from_json.name, from_json.v) == (9, "bob", 2)


def test_the_current_version_needs_no_upcast() -> None:
    event = Greeting(name="cy")
    assert event.v == 2
    assert events.decode(events.encode(event)) == event


def test_a_newer_version_becomes_unknown() -> None:
    raw = {"kind": "message", "v": 99, "content": "from the future", "mood": "curious"}
    event = events.decode(msgspec.msgpack.encode(raw), 1)
    assert isinstance(event, events.Unknown)
    assert event.original_kind == "message"
    assert event.payload == raw
    assert msgspec.msgpack.decode(events.encode(event)) == raw


# --- registration, schema, bad bytes ----------------------------------------------------------


def test_a_custom_kind_is_decoded_and_in_the_schema() -> None:
    event = Deploy(service="api", replicas=3, tenant="acme")
    assert events.kinds()["test_deploy"] is Deploy
    assert events.decode(events.encode(event)) == event
    minimal = events.decode_json(b'{"kind":"test_deploy","service":"web"}')
    assert minimal == Deploy(service="web", ts=minimal.ts)
    defs = events.json_schema()["$defs"].values()
    assert any(d.get("properties", {}).get("kind") == {"enum": ["test_deploy"]} for d in defs)


def test_registering_a_taken_tag_is_refused() -> None:
    assert events.register(Deploy) is Deploy  # the same class again is fine

    class Impostor(events.Action, frozen=True, kw_only=True, tag="test_deploy"):
        service: str

    with pytest.raises(ValueError, match="already registered by Deploy"):
        events.register(Impostor)

    class Clash(events.Action, frozen=True, kw_only=True, tag="message"):
        text: str

    with pytest.raises(ValueError, match="'message' is already registered"):
        events.register(Clash)
    with pytest.raises(TypeError):
        events.register(dict)  # type: ignore[arg-type]
    assert events.kinds()["message"] is events.Message


def test_json_schema_covers_every_kind() -> None:
    schema = events.json_schema()
    tags = set()
    for definition in schema["$defs"].values():
        kind = definition.get("properties", {}).get("kind", {})
        tags.update(kind.get("enum", []))
    assert set(events.kinds()) <= tags
    assert len(schema["anyOf"]) == len(events.kinds())
    assert schema["discriminator"]["propertyName"] == "kind"


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"not msgpack", msgspec.msgpack.encode([1, 2]), b"\x81\xa1"])
def test_undecodable_bytes_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(events.DecodeError):
        events.decode(payload)


@pytest.mark.parametrize(
    "text", [b"", b"{", b"[1]", b'"message"', b'{"kind":"message"}', b'{"kind":"cmd_run","command":1}']
)
def test_bad_json_raises_decode_error(text: bytes) -> None:
    with pytest.raises(events.DecodeError):
        events.decode_json(text)


def test_ids_are_not_stored_in_the_payload() -> None:
    event = events.Think(thought="x", id=12)
    assert msgspec.msgpack.decode(events.encode(event)).get("id") is None
    assert events.decode(events.encode(event)).id is None
    assert events.decode(events.encode(event), 12).id == 12


def test_what_a_copy_skipped_is_written_only_when_it_skipped_something() -> None:
    (line,) = [line for line in golden_lines() if b'"kind":"sandbox_rebuilt"' in line and b'"skipped"' not in line]
    older = events.decode_json(line)
    assert isinstance(older, events.SandboxRebuilt)
    assert older.skipped is msgspec.UNSET
    assert events.encode_json(older) == line  # a record from before the field exports byte for byte
    newer = msgspec.structs.replace(older, skipped=[events.Skipped(path="logs/pipe", reason="fifo")])
    assert events.decode(events.encode(newer), newer.id) == newer
    assert events.decode_json(events.encode_json(newer)) == newer
    assert b'"skipped":[{"path":"logs/pipe","reason":"fifo"}]' in events.encode_json(newer)
