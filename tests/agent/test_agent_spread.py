"""A cadence sample's work spread over its phases (agent/weightstats.py): no step pays it whole.

A model whose weight norms are read over several steps also has its update
ratios measured a group of layers per step and its activation modules hooked a
few per step; the sample ships complete once its phases are done.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.agent import activations, updateratios
from gradwatch.agent.gradients import GradReader
from gradwatch.agent.hostpart import HostPart
from gradwatch.agent.layout import MISSING_I32, fill_missing
from gradwatch.agent.updateratios import RatioSampler
from gradwatch.agent.weightstats import Round


def _missing(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) == MISSING_I32


def _recording(mon: Any) -> list[Round]:
    """The samples ``mon`` queues from now on (what would be shipped, without a collector)."""
    shipped: list[Round] = []
    original = mon._queue_stats

    def record(done: Round) -> None:
        shipped.append(done)
        original(done)

    mon._queue_stats = record
    return shipped


def _values(part: torch.Tensor | HostPart | None) -> torch.Tensor:
    """A sample's statistic: a device vector (measured whole) or a host copy's values."""
    assert part is not None
    return part if isinstance(part, torch.Tensor) else part.values()


def test_a_groups_ratios_equal_the_whole_models_on_the_same_update() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 200), nn.Linear(200, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reader = GradReader.attach(model, opt)
    whole, grouped = RatioSampler(reader), RatioSampler(reader, groups=3)
    spans = [grouped.layers_of(g) for g in range(3)]
    assert spans[0][0] == 0 and spans[-1][1] == 6 and all(a < b for a, b in spans)
    assert all(spans[g][1] == spans[g + 1][0] for g in range(2))  # consecutive, no gaps
    seen = torch.empty(6)
    fill_missing(seen)
    for g in range(3):
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        whole.sample_before()
        grouped.sample_before(g)
        opt.step()
        reference = whole.ratios()  # worked out on the device
        grouped.after(g)
        mine = grouped.export().values()  # a host copy, worked out as the shipper does
        first, stop = spans[g]
        assert torch.equal(mine[first:stop], reference[first:stop])
        assert _missing(mine[:first]).all() and _missing(mine[stop:]).all()
        seen[first:stop] = mine[first:stop]
    assert not _missing(seen).any() and (seen > 0).all()
    # No before-gather of group 1 since its last ratios: its slots are MISSING.
    grouped.sample_before(0)
    opt.step()
    assert _missing(grouped.ratios(1))[spans[1][0] : spans[1][1]].all()


class _Skipping(nn.Module):
    """Two blocks, the second skipped when ``skip`` is set (LayerDrop: no gradient then)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h if self.skip else self.b(h)


@pytest.mark.parametrize("host", [False, True], ids=["device", "host copy"])
def test_a_layer_skipped_in_the_step_has_no_ratio(host: bool) -> None:
    # The optimizer skips a parameter whose .grad is None, so its 0 would read as a
    # frozen layer: LayerDrop's skipped blocks (fairseq, HF's config.layerdrop) paged
    # "layers never change" on healthy runs. Not measured that step: MISSING. A layer
    # without a gradient for longer (never used, or cut off) keeps its 0.
    torch.manual_seed(0)
    model = _Skipping()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = RatioSampler(GradReader.attach(model, opt))

    def ratios(skip: bool) -> torch.Tensor:
        model.skip = skip
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        sampler.sample_before()
        opt.step()
        if not host:
            return sampler.ratios()
        sampler.after()
        return sampler.export().values()

    assert (ratios(False) > 0).all()
    for _ in range(updateratios.SKIPPED_SAMPLES):
        skipped = ratios(True)
        assert _missing(skipped[2:]).all() and (skipped[:2] > 0).all()
    cut = ratios(True)  # no gradient for longer: it does not move, and says so
    assert not _missing(cut).any() and (cut[2:] == 0).all()
    moved = ratios(False)
    assert not _missing(moved).any() and (moved > 0).all()


def _gelu_mlp() -> nn.Sequential:
    # 8 weight tensors of ~262k elements: weight norms in 8 phases, and 3 GELUs.
    layers: list[nn.Module] = []
    for i in range(4):
        layers.append(nn.Linear(512, 512))
        if i < 3:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


@pytest.mark.parametrize("early", [False, True], ids=["sparse", "dense start"])
def test_a_sample_far_from_the_next_is_measured_a_part_per_step(monkeypatch, early: bool) -> None:
    torch.manual_seed(0)
    model = _gelu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model,
        opt,
        job="spread",
        endpoint="tcp://127.0.0.1:1",
        stats_every=8,
        early_stats=early,
    )
    assert mon._wstats is not None and mon._wstats.phases == 8

    hooked: list[int] = []  # activation hooks run per step
    groups: list[int | None | str] = []  # update-ratio groups gathered per step
    measure, before = activations.measure, updateratios.RatioSampler.sample_before

    def count_hook(*args: Any) -> None:
        hooked[-1] += 1
        measure(*args)

    def count_group(self: RatioSampler, group: int | None = None, keep_views: bool = True) -> None:
        groups[-1] = "all" if group is None else group
        before(self, group, keep_views)

    monkeypatch.setattr(activations, "measure", count_hook)
    monkeypatch.setattr(updateratios.RatioSampler, "sample_before", count_group)
    acts = mon._acts
    assert acts is not None and len(acts.columns) == 3 * 3
    export, stats, snapshots = acts.export, acts.stats, []

    def keep_export() -> Any:  # a spread sample's: a host copy
        copy = export()
        snapshots.append(copy.values())
        return copy

    def keep_stats() -> torch.Tensor:  # a whole sample's: on the device
        snapshots.append(stats())
        return snapshots[-1]

    monkeypatch.setattr(acts, "export", keep_export)
    monkeypatch.setattr(acts, "stats", keep_stats)
    shipped = _recording(mon)
    for _ in range(23):
        hooked.append(0)
        groups.append(None)
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    if early:
        # Samples on steps 1-8 come one step apart: each is measured whole on its
        # own step (weight norms still a phase per step, shared).
        assert groups[:8] == ["all"] * 8 and hooked[:8] == [3] * 8
        assert [done.step for done in shipped][:8] == list(range(1, 9))
        assert len(snapshots) >= 8
    else:
        # Steps 8-15 carry the step-8 sample's parts, 16-23 the next one's: fewer steps
        # than units (8 weight phases, a ratio group per layer, 3 hook groups), so each
        # kind is spread over the 8 steps, none twice on a step (agent/spreadplan.py).
        assert [done.step for done in shipped] == [8, 16]
        assert mon._wstats.ratio.groups == 8
        assert groups[:7] == [None] * 7
        for run in (groups[7:15], groups[15:23]):
            assert run == [(g, g + 1) for g in range(8)]
        assert max(hooked) == 1 and sum(hooked) == 2 * 3  # each module once per sample
        assert len(snapshots) == 2
    mon.close()
    for done in shipped:
        ratios = _values(done.ratio_values)
        assert not _missing(ratios).any() and (ratios > 0).all()
        assert done.norms is not None and not _missing(done.norms).any()
    for snap in snapshots[:2]:
        assert not _missing(snap).any()  # every module measured, on its phase


@pytest.mark.parametrize("manual", [False, True], ids=["optimizer", "hand-written update"])
def test_a_spread_sample_reports_every_layers_ratio(manual: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(400, 400), nn.Linear(400, 400))  # 3 phases
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gradwatch.watch(
        model,
        None if manual else opt,
        job="spread",
        endpoint="tcp://127.0.0.1:1",
        stats_every=4,
        early_stats=False,
    )
    assert mon._wstats is not None and mon._wstats.phases == 3
    shipped = _recording(mon)
    for _ in range(11):
        opt.zero_grad()
        model(torch.randn(8, 400)).square().mean().backward()
        if manual:
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(0.05 * p.grad)
        else:
            opt.step()
        mon.log(loss=1.0)
    mon.close()
    assert [done.step for done in shipped] == [4, 8]  # steps 4-6 and 8-10
    for done in shipped:
        ratios = _values(done.ratio_values)
        assert not _missing(ratios).any()
        assert (ratios > 0).all() and (ratios < 1).all()


def test_statistics_worked_out_on_the_host_equal_those_worked_out_on_the_device() -> None:
    # A spread sample ships host copies the shipper works out (agent/hostpart.py); a
    # whole one works them out on the device. Same formulas: the same numbers.
    torch.manual_seed(0)
    # The Linear after the softmax keeps it a hidden one: an output softmax is not measured.
    model = nn.Sequential(
        nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 300),
        nn.Tanh(), nn.Linear(300, 10), nn.Softmax(dim=-1), nn.Linear(10, 10),
    )  # fmt: skip
    hooks = activations.ActHooks.attach(model, torch.device("cpu"), on_error=None)
    assert hooks is not None and hooks.groups == 4
    hooks.arm()
    with torch.no_grad():
        model(torch.randn(256, 64) * 3)
    hooks.disarm()
    device, host = hooks.stats(), hooks.export().values()
    assert not _missing(device).any()
    assert torch.allclose(device, host, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("extra", [3, -2], ids=["mid-sample", "after its copies"])
def test_a_spread_sample_cut_short_by_close_ships_what_it_measured(extra: int) -> None:
    torch.manual_seed(0)
    model = _gelu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model, opt, job="spread", endpoint="tcp://127.0.0.1:1", stats_every=40, early_stats=False
    )
    shipped = _recording(mon)
    parts = None
    steps = 40 + extra if extra > 0 else 0
    for step in range(1, 200):
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
        if step == 40:
            parts = mon._parts
            steps = steps or 40 + len(parts) + extra  # two steps before its ship
        if steps and step >= steps:
            break
    assert parts and not shipped  # the sample at step 40 is still being measured
    mon.close()
    (done,) = shipped
    ratios, acts = _values(done.ratio_values), _values(done.acts)
    if extra > 0:  # three steps in: some groups and modules measured, the rest MISSING
        assert _missing(ratios).any() and not _missing(ratios).all()
    else:  # every group and module measured before the copies were made
        assert not _missing(ratios).any() and not _missing(acts).any()
    assert done.norms is not None and not _missing(done.norms).any()


def test_while_the_shipper_holds_the_last_copies_the_next_sample_is_worked_out_here(
    pull,
) -> None:
    # MAX_STATS_IN_FLIGHT bounds the host copies held: a sample whose copy step comes
    # before the shipper took the last sample's is worked out on the device instead,
    # complete, and nothing is dropped.
    torch.manual_seed(0)
    model = _gelu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(
        model, opt, job="spread", endpoint=pull[1], stats_every=8, early_stats=False
    )
    shipped = _recording(mon)
    unshipped = SimpleNamespace(shipped=False)  # the last sample, not yet taken
    for step in range(1, 16):
        if step == 14:  # the step-8 sample's copy step
            mon._stats_out = [unshipped]  # type: ignore[list-item]
        model(torch.randn(8, 512)).square().mean().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    (done,) = shipped
    assert isinstance(done.acts, torch.Tensor) and isinstance(done.ratio_values, torch.Tensor)
    assert not _missing(done.acts).any() and not _missing(done.ratio_values).any()
    mon.close()
    assert mon.stats.stats_sent == 1 and mon.stats.stats_dropped == 0  # sent, not dropped
