"""Ingest turns the activation columns of a cadence-statistics batch into ``ActStats``."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gradwatch.collector.ingest import Ingest
from gradwatch.rules.step import ActStats
from gradwatch.wire import MISSING_BITS, Batch, Schema, encode
from gradwatch.wire import columns as wc

MISSING = struct.unpack("<f", struct.pack("<I", MISSING_BITS))[0]


def stats_batch(columns: tuple[str, ...], row: list[float]) -> Batch:
    schema = Schema(wc.STATS_SCHEMA_ID, (wc.WEIGHT_NORMS, *columns), ("w",))
    values = np.array([[MISSING, *row, 2.0]], "<f4").tobytes()
    return Batch("run", 0, 1, schema.id, 0, "inc", 0, (10,), (1.0,), values, schema)


def test_activation_columns_become_act_stats() -> None:
    columns = (
        wc.act("enc/0.act", "relu", "mean"),
        wc.act("enc/0.act", "relu", "std"),
        wc.act("enc/0.act", "relu", "zero_frac"),
        wc.act("h", "tanh", "mean"),
        wc.act("h", "tanh", "std"),
        wc.act("h", "tanh", "sat_frac"),
        wc.act("lk", "other", "mean"),
        wc.act("lk", "other", "std"),
        wc.act("idle", "sigmoid", "mean"),
        wc.act("idle", "sigmoid", "std"),
        wc.act("idle", "sigmoid", "sat_frac"),
        "act/garbled",
    )
    row = [0.5, 0.25, 0.75, 0.0, 0.9, 0.875, 0.1, 1.0, MISSING, MISSING, MISSING, 3.0]
    (stats,) = Ingest().feed(encode(stats_batch(columns, row))).stats
    assert stats.step == 10 and stats.layers == ("w",)
    assert list(stats.weight_norms) == [2.0]
    assert stats.act == (
        ActStats("enc/0.act", "relu", 0.5, 0.25, zero_frac=0.75),  # "/" in a module name survives
        ActStats("h", "tanh", 0.0, pytest.approx(0.9), sat_frac=0.875),
        ActStats("lk", "other", pytest.approx(0.1), 1.0),
    )  # "idle" was not measured this step (MISSING): left out; unknown columns ignored


def test_stats_batch_without_activation_columns_has_no_act() -> None:
    (stats,) = Ingest().feed(encode(stats_batch((), []))).stats
    assert stats.act == () and list(stats.weight_norms) == [2.0]


def test_update_ratio_columns_align_with_layers() -> None:
    schema = Schema(
        wc.STATS_SCHEMA_ID,
        (wc.WEIGHT_NORMS, wc.update_ratio("b"), wc.update_ratio("a")),
        ("a", "b", "c"),
    )
    values = np.array(
        [[MISSING, 0.5, 0.25, 1.0, 2.0, 3.0], [MISSING, MISSING, MISSING, 1.0, 2.0, 3.0]], "<f4"
    ).tobytes()
    batch = Batch("run", 0, 1, schema.id, 0, "inc", 0, (2, 4), (1.0, 2.0), values, schema)
    first, second = Ingest().feed(encode(batch)).stats
    assert first.layers == ("a", "b", "c")
    ratios = first.update_ratios
    assert ratios is not None and list(ratios[:2]) == [0.25, 0.5] and np.isnan(ratios[2])
    assert second.update_ratios is None  # none measured (an AMP-skipped cadence step)
