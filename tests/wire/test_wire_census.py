"""Layer roles and the census on the wire and in traces: optional, round-tripping, checked."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradwatch.wire import (
    Batch,
    Schema,
    TraceError,
    TraceHeader,
    TraceReader,
    TraceStats,
    WireError,
    decode,
    encode,
)
from gradwatch.wire.census import (
    MAX_CENSUS_NAME_CHARS,
    MAX_CENSUS_NAMES,
    MAX_GROUP_RUNS,
    MAX_TOWER_LAYERS,
    MAX_TOWER_RUNS,
    Census,
    CensusError,
    capped_names,
    census_body,
    census_of,
    roles_for,
)
from gradwatch.wire.trace import encode_record

CENSUS = Census(
    params_total=100,
    params_trainable=60,
    params_frozen=30,
    params_not_in_optimizer=10,
    frozen_modules=(("backbone", 30),),
    not_in_optimizer=("neck.weight",),
    tied=(("wte.weight", "lm_head.weight"),),
    eval_modules=("bn",),
    model_training=False,
)

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
censuses = st.builds(
    Census,
    st.integers(0, 2**40),
    st.integers(0, 2**40),
    st.integers(0, 2**40),
    st.integers(0, 2**40),
    st.lists(st.tuples(names, st.integers(0, 2**40)), max_size=5).map(tuple),
    st.lists(names, max_size=5).map(tuple),
    st.lists(st.lists(names, min_size=2, max_size=4).map(tuple), max_size=3).map(tuple),
    st.lists(names, max_size=5).map(tuple),
    st.booleans(),
    st.lists(st.integers(-1, 3), max_size=12).map(tuple),
    st.booleans(),
)


def stats_batch(census: Census | None, schema: Schema | None = None) -> Batch:
    schema = schema or Schema(1 << 30, ("stats/weight_norm",), ("w",))
    return Batch("job", 0, 1, schema.id, 0, "inc", 0, (5,), (1.0,), bytes(8), schema, census=census)


@given(censuses)
def test_census_round_trips_through_json_wire_and_trace(census: Census) -> None:
    assert census_of(json.loads(json.dumps(census_body(census)))) == census
    assert decode(encode(stats_batch(census))).census == census
    lines = [
        encode_record(TraceHeader(job="j", layers=("w",))),
        encode_record(TraceStats(step=5, layer_weight_norms=(1.0,), census=census)),
    ]
    (rec,) = list(TraceReader(lines))
    assert isinstance(rec, TraceStats) and rec.census == census


def test_roles_ride_in_the_schema_and_the_trace_header_and_are_optional() -> None:
    schema = Schema(3, ("loss",), ("wte.weight", "ln.weight"), layer_roles=("tied", "norm"))
    batch = Batch("job", 0, 1, 3, 0, "inc", 0, (1,), (1.0,), bytes(12), schema)
    assert decode(encode(batch)).schema == schema
    bare = Schema(3, ("loss",), ("w",))
    assert decode(encode(stats_batch(None, bare))).schema.layer_roles == ()
    header = TraceHeader(job="j", layers=("a", "b"), layer_roles=("weight", "bias"))
    assert TraceReader([encode_record(header)]).header == header
    assert "layer_roles" not in encode_record(TraceHeader(job="j", layers=("a",)))
    assert decode(encode(stats_batch(None))).census is None


def test_an_unknown_role_reads_as_other_and_a_misaligned_list_is_refused() -> None:
    frames = encode(
        Batch(
            "job",
            0,
            1,
            3,
            0,
            "inc",
            0,
            (1,),
            (1.0,),
            bytes(12),
            Schema(3, ("loss",), ("a", "b"), layer_roles=("weight", "norm")),
        )
    )
    schema = json.loads(frames[1])
    schema["layer_roles"] = ["weight", "lora_adapter"]  # a later agent's role
    assert decode([frames[0], json.dumps(schema).encode(), frames[2]]).schema.layer_roles == (
        "weight",
        "other",
    )
    schema["layer_roles"] = ["weight"]
    with pytest.raises(WireError, match="layer_roles"):
        decode([frames[0], json.dumps(schema).encode(), frames[2]])
    bad_header = {"type": "header", "version": 1, "job": "j", "layers": ["a"], "layer_roles": [1]}
    with pytest.raises(TraceError, match="layer_roles"):
        # The property read itself must raise.
        TraceReader([json.dumps(bad_header)]).header  # noqa: B018


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"total": -1}, "census.total"),
        ({"frozen": 1.5}, "census.frozen"),
        ({"eval_modules": ["x"] * (MAX_CENSUS_NAMES + 1)}, "census.eval_modules"),
        ({"eval_modules": ["x" * (MAX_CENSUS_NAME_CHARS + 1)]}, "census.eval_modules"),
        ({"frozen_modules": [["a"]]}, "census.frozen_modules"),
        ({"model_training": "yes"}, "census.model_training"),
        ({"tied": [["a", "b"]] * 100}, "census.tied"),
        ({"supervised_loss": 0}, "census.supervised_loss"),
        ({"towers": [[0, 0]]}, "census.towers"),
        ({"towers": [[-2, 1]]}, "census.towers"),
        ({"towers": [[0, True]]}, "census.towers"),
        ({"towers": [[0, 1, 1]]}, "census.towers"),
        ({"towers": [[0, 1]] * (MAX_TOWER_RUNS + 1)}, "census.towers"),
        # Runs within the cap that add up past it: a hostile sender's 16M-entry tuple.
        ({"towers": [[0, MAX_TOWER_LAYERS]] * 256}, "census.towers"),
        ({"groups": [[-2, 1]]}, "census.groups"),
        ({"eval_norms_only": 1}, "census.eval_norms_only"),
        ({"groups": [[0, 1], [1, 1]] * (MAX_GROUP_RUNS // 2 + 1)}, "census.groups"),
    ],
)
def test_hostile_census_fields_are_wire_errors(change: dict, message: str) -> None:
    body = census_body(CENSUS) | change
    with pytest.raises(CensusError, match=message):
        census_of(body)
    head = encode(stats_batch(CENSUS))
    header = json.loads(head[0][4:])
    header["census"] = body
    with pytest.raises(WireError, match=message):
        decode([head[0][:4] + json.dumps(header).encode(), *head[1:]])


def test_a_census_at_its_caps_fits_a_wire_header() -> None:
    long = ["m" * 2000] * 100
    worst = Census(
        2**40,
        2**40,
        2**40,
        2**40,
        frozen_modules=tuple((n, 2**40) for n in capped_names(long)),
        not_in_optimizer=capped_names(long),
        tied=(capped_names(long, 4),) * 16,
        eval_modules=capped_names(long),
    )
    assert decode(encode(stats_batch(worst))).census == worst


def test_towers_travel_as_runs_and_a_plain_census_stays_as_it_was() -> None:
    told = Census(10, 10, 0, 0, towers=(0, 0, 0, 1, 1, -1), supervised_loss=False)
    body = census_body(told)
    assert body["towers"] == [[0, 3], [1, 2], [-1, 1]] and body["supervised_loss"] is False
    assert census_of(body) == told
    plain = census_body(Census(10, 10, 0, 0))
    assert "towers" not in plain and "supervised_loss" not in plain


def test_param_groups_travel_as_runs_too() -> None:
    # A weight-decay split alternates groups layer by layer: one run per layer.
    told = Census(10, 10, 0, 0, groups=(0, 1, 0, 1, 2, 2, -1))
    body = census_body(told)
    assert body["groups"] == [[0, 1], [1, 1], [0, 1], [1, 1], [2, 2], [-1, 1]]
    assert census_of(body) == told
    assert "groups" not in census_body(Census(10, 10, 0, 0))
    frozen_bn = Census(10, 10, 0, 0, eval_modules=("bn",), eval_norms_only=True)
    assert census_of(census_body(frozen_bn)) == frozen_bn
    assert "eval_norms_only" not in census_body(Census(10, 10, 0, 0))


def test_roles_follow_the_layers_a_record_keeps() -> None:
    assert roles_for(("a", "c"), ("a", "b", "c"), ("tied", "norm", "weight")) == ("tied", "weight")
    assert roles_for(("a", "x"), ("a", "b"), ("tied", "norm")) == ()
    assert roles_for(("a",), ("a",), ()) == ()
