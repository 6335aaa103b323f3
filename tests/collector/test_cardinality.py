"""Cardinality: a 70B-like model on 1,024 ranks renders a bounded number of series.

The synthetic model has Llama-70B's shape of names (80 blocks of 9 tensors,
embeddings, final norm and head: 723 layers); every rank reports one step.
Series are counted from the parsed Prometheus text, as Prometheus would see it.
"""

from __future__ import annotations

import doctest
import math
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gradwatch.collector import blocks
from gradwatch.collector.blocks import block_of
from gradwatch.collector.exposition import GradwatchCollector
from gradwatch.collector.ingest import Ingest
from gradwatch.collector.state import StateStore
from gradwatch.rules.step import Step

JOB = "llama-70b"
NOW = 1_700_000_000.0
RANKS = 1024
BLOCKS = 80
PER_BLOCK = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
LAYERS = (
    "model.embed_tokens.weight",
    *(f"model.layers.{b}.{p}" for b in range(BLOCKS) for p in PER_BLOCK),
    "model.norm.weight",
    "lm_head.weight",
)
# Built by hand, independently of block_of: which layer indices make each block.
EXPECTED_BLOCKS = {
    "model.embed_tokens": [0],
    "model.norm": [len(LAYERS) - 2],
    "lm_head": [len(LAYERS) - 1],
    **{f"model.layers.{b}": list(range(1 + 9 * b, 10 + 9 * b)) for b in range(BLOCKS)},
}
CAPS = {"max_layer_series": 256, "max_block_series": 512, "max_rank_series": 64}
# Series of one job that are not per layer, block or rank: step, loss, grad norm,
# learning rate (one group here), non-finite count, ranks, last seen, eval loss,
# loss scale, oldest rank, ratio, three *_series_capped flags and two ingest counters.
PER_JOB_SCALARS = 16
CAPPED = (
    "gradwatch_rank_last_seen_timestamp_seconds",
    "gradwatch_block_grad_norm",
    "gradwatch_layer_grad_norm",
)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def norms(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(mean=0.0, sigma=2.0, size=len(LAYERS))


def feed(store: StateStore, clock: Clock, lead_norms: np.ndarray) -> list[int]:
    """One step from every rank, in shuffled order; returns ranks from least to most recent."""
    order = list(range(RANKS))
    random.Random(7).shuffle(order)
    others = norms(1)
    for i, rank in enumerate(order):
        clock.now = NOW + i * 0.01
        store.observe_step(
            Step(
                job=JOB,
                step=100,
                time=clock.now,
                rank=rank,
                loss=2.0,
                grad_norm=1.0,
                layers=LAYERS,
                layer_norms=lead_norms if rank == 0 else others,
                lr=(3e-4,),
            )
        )
    return order


def scrape(store: StateStore, **kwargs: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Series of JOB by family name, parsed from a fresh registry's text."""
    registry = CollectorRegistry()
    registry.register(GradwatchCollector(store, Ingest().stats, **{**CAPS, **kwargs}))
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.labels.get("training_job") == JOB:
                families.setdefault(family.name, []).append((sample.labels, sample.value))
    return families


def count(families: dict[str, list[Any]]) -> int:
    return sum(len(series) for series in families.values())


@pytest.fixture(scope="module")
def fed() -> Iterator[tuple[StateStore, list[int], np.ndarray]]:
    clock = Clock()
    store = StateStore(clock=clock)
    lead = norms(0)
    lead[EXPECTED_BLOCKS["model.layers.37"][4]] = np.nan
    lead[EXPECTED_BLOCKS["model.layers.61"][0]] = np.inf
    yield store, feed(store, clock, lead), lead


@pytest.mark.parametrize("per_layer", [False, True])
def test_series_per_job_stay_bounded_by_the_caps(
    fed: tuple[StateStore, list[int], np.ndarray], per_layer: bool
) -> None:
    store, _, _ = fed
    families = scrape(store, per_layer_metrics=per_layer)
    bound = (
        PER_JOB_SCALARS
        + CAPS["max_rank_series"]
        + CAPS["max_block_series"]
        + CAPS["max_layer_series"] * per_layer
    )
    assert count(families) <= bound < 1000
    assert len(families["gradwatch_rank_last_seen_timestamp_seconds"]) == CAPS["max_rank_series"]
    assert len(families["gradwatch_block_grad_norm"]) == len(EXPECTED_BLOCKS) == 83
    assert (
        len(families.get("gradwatch_layer_grad_norm", [])) == CAPS["max_layer_series"] * per_layer
    )
    # Every other family is one series per job. Measured (quoted in the README):
    # 158 series without per-layer ones, 415 with them.
    scalars = {name: len(series) for name, series in families.items() if name not in CAPPED}
    assert set(scalars.values()) == {1} and len(scalars) <= PER_JOB_SCALARS


def test_rank_series_are_the_ranks_silent_longest_and_the_job_keeps_aggregates(
    fed: tuple[StateStore, list[int], np.ndarray],
) -> None:
    store, order, _ = fed
    families = scrape(store)
    shown = {
        int(labels["rank"]) for labels, _ in families["gradwatch_rank_last_seen_timestamp_seconds"]
    }
    assert shown == set(order[: CAPS["max_rank_series"]])
    assert families["gradwatch_job_ranks"][0][1] == RANKS
    assert families["gradwatch_job_oldest_rank_last_seen_timestamp_seconds"][0][1] == NOW
    assert families["gradwatch_rank_series_capped"][0][1] == 1.0
    uncapped = scrape(store, max_rank_series=RANKS)
    assert len(uncapped["gradwatch_rank_last_seen_timestamp_seconds"]) == RANKS
    assert uncapped["gradwatch_rank_series_capped"][0][1] == 0.0


def test_block_norms_are_the_root_sum_of_squares_of_their_layers(
    fed: tuple[StateStore, list[int], np.ndarray],
) -> None:
    store, _, lead = fed
    values = {
        labels["block"]: value for labels, value in scrape(store)["gradwatch_block_grad_norm"]
    }
    assert set(values) == set(EXPECTED_BLOCKS)
    assert math.isnan(values["model.layers.37"])
    assert values["model.layers.61"] == math.inf
    for block, indices in EXPECTED_BLOCKS.items():
        if block in ("model.layers.37", "model.layers.61"):
            continue
        expected = math.sqrt(sum(float(lead[i]) ** 2 for i in indices))
        assert values[block] == pytest.approx(expected, rel=1e-12), block


def test_top_k_keeps_non_finite_offenders_first_then_the_largest(
    fed: tuple[StateStore, list[int], np.ndarray],
) -> None:
    store, _, lead = fed
    families = scrape(store, per_layer_metrics=True, max_block_series=5, max_layer_series=10)
    shown = {labels["block"]: value for labels, value in families["gradwatch_block_grad_norm"]}
    finite = {
        block: math.sqrt(sum(float(lead[i]) ** 2 for i in indices))
        for block, indices in EXPECTED_BLOCKS.items()
        if block not in ("model.layers.37", "model.layers.61")
    }
    largest = sorted(finite, key=finite.__getitem__)[-3:]
    assert set(shown) == {"model.layers.37", "model.layers.61", *largest}
    assert families["gradwatch_block_series_capped"][0][1] == 1.0
    layers = {labels["layer"]: value for labels, value in families["gradwatch_layer_grad_norm"]}
    nan_layer = LAYERS[EXPECTED_BLOCKS["model.layers.37"][4]]
    assert math.isnan(layers[nan_layer])
    assert layers[LAYERS[EXPECTED_BLOCKS["model.layers.61"][0]]] == math.inf
    finite_shown = sorted(v for v in layers.values() if math.isfinite(v))
    assert finite_shown == sorted(v for v in lead.tolist() if math.isfinite(v))[-8:]


def test_an_expired_job_has_no_series_on_the_next_scrape() -> None:
    clock = Clock()
    store = StateStore(job_ttl_seconds=600.0, clock=clock)
    feed(store, clock, norms(0))
    assert count(scrape(store, per_layer_metrics=True)) > 0
    clock.now += 601.0  # past the TTL even for the last rank heard from
    assert store.expire() == [JOB]
    assert count(scrape(store, per_layer_metrics=True)) == 0


@pytest.mark.parametrize(
    ("layer", "block"),
    [
        ("model.layers.12.mlp.up_proj.weight", "model.layers.12"),
        ("transformer.h.3.attn.c_attn.weight", "transformer.h.3"),
        ("embed_tokens.weight", "embed_tokens"),
        ("lm_head.weight", "lm_head"),
        ("0.weight", "0"),  # nn.Sequential
        ("encoder.layer².weight", "encoder.layer²"),  # not an ASCII number: no block index
    ],
)
def test_block_of(layer: str, block: str) -> None:
    assert block_of(layer) == block


def test_block_examples_in_the_docstrings_hold() -> None:
    assert doctest.testmod(blocks, raise_on_error=True).attempted >= 4
