"""Cadence statistics at a bounded cost: the early schedule, sampled update ratios, spread norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.agent.cadence import Cadence
from gradwatch.agent.gradients import GradReader
from gradwatch.agent.updateratios import MIN_SAMPLE
from gradwatch.agent.weightstats import WeightStats

# The sampled update ratio is within this relative error of the exact one ...
RATIO_TOLERANCE = 0.10
# ... while the samples (before and after) hold less than this share of the parameters.
HELD_FRACTION = 0.05


def due_steps(cadence: Cadence, last: int) -> list[int]:
    return [s for s in range(1, last + 1) if cadence.due(s)]


def test_early_cadence_is_dense_at_the_start_then_backs_off_to_stats_every() -> None:
    steps = due_steps(Cadence(50), 1000)
    assert steps[:8] == list(range(1, 9))
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert gaps == sorted(gaps) and max(gaps) == 50  # geometric back-off, capped
    # A fault starting at any step t is sampled within max(1, t // 4) steps, so
    # within 20 steps of onset early on, and within stats_every later.
    for t in range(1, 1000):
        wait = next(s for s in steps if s >= t) - t if t <= steps[-1] - 50 else 0
        assert wait <= min(50, max(1, t // 4))
    assert due_steps(Cadence(50, early=False), 200) == [50, 100, 150, 200]
    assert due_steps(Cadence(0), 100) == []


def test_restart_makes_the_cadence_dense_again_and_force_pulls_the_next_sample() -> None:
    cadence = Cadence(50)
    due_steps(cadence, 400)  # well into the sparse part
    cadence.restart(401)
    assert [s for s in range(401, 420) if cadence.due(s)][:8] == list(range(401, 409))
    sparse = Cadence(50, early=False)
    assert not sparse.due(7)
    sparse.force_next()
    assert sparse.due(8) and not sparse.due(9) and sparse.due(50)
    sparse.force_next()
    assert sparse.take_forced() and not sparse.take_forced()


def test_watch_ships_dense_early_statistics_and_again_after_data_changed() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gradwatch.watch(model, opt, job="cost", endpoint="tcp://127.0.0.1:1", stats_every=50)
    queued: list[int] = []
    original = mon._queue_stats

    def record(done):  # what would be shipped, without a collector
        queued.append(done.step)
        original(done)

    # The test replaces the method to record calls.
    mon._queue_stats = record  # type: ignore[method-assign]
    for step in range(1, 121):
        if step == 101:
            mon.data_changed("new shard mix")
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    assert queued[:8] == list(range(1, 9))
    assert [s for s in queued if 50 < s <= 100] == [51, 63, 78, 97]
    assert [s for s in queued if s > 100][:8] == list(range(101, 109))


def _exact_ratios(before: list[torch.Tensor], model: nn.Module) -> list[float]:
    return [
        ((p.detach() - b).norm() / p.detach().norm()).item()
        for p, b in zip(model.parameters(), before, strict=True)
    ]


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    ],
    ids=["adamw", "sgd-momentum"],
)
def test_sampled_update_ratio_is_close_to_the_exact_one_holding_a_small_share(make_opt) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(512, 256),
        nn.Flatten(),
        nn.Linear(256 * 4, 1024),
        nn.GELU(),
        nn.Linear(1024, 512),
        nn.GELU(),
        nn.Linear(512, 10),
    )
    opt = make_opt(model.parameters())
    ws = WeightStats(GradReader.attach(model, opt))
    total = sum(p.numel() for p in model.parameters())
    assert 2 * ws.sample_elements < HELD_FRACTION * total
    errors = []
    for _ in range(5):
        x, y = torch.randint(0, 512, (64, 4)), torch.randint(0, 10, (64,))
        nn.functional.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        ws.sample_before()
        opt.step()
        sampled = ws.ratio.ratios().tolist()
        exact = _exact_ratios(before, model)
        for p, s, e in zip(model.parameters(), sampled, exact, strict=True):
            if p.numel() <= MIN_SAMPLE:
                assert s == pytest.approx(e, rel=1e-4)  # sampled whole: exact
            elif e > 0:
                errors.append(abs(s - e) / e)
        opt.zero_grad()
    assert errors and max(errors) < RATIO_TOLERANCE


def test_a_skipped_update_gives_missing_ratios_not_zero() -> None:
    model = nn.Linear(3, 2)
    ws = WeightStats(GradReader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    out = ws.ratio.ratios()  # no sample_before: the optimizer step did not run
    assert out.isnan().all()


def test_a_parameter_given_new_storage_during_the_step_still_gets_its_ratio() -> None:
    # The after-gather reuses the pre-hook's views only while every parameter keeps its
    # storage; an update written as p.data = ... (new storage) is gathered afresh.
    def ratios(new_storage: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
        ws = WeightStats(GradReader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1)))
        model(torch.randn(4, 64)).sum().backward()
        ws.sample_before()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                if new_storage:
                    p.data = p.data - 0.1 * p.grad  # a hand-written update: new storage
                else:
                    p.sub_(0.1 * p.grad)
        return ws.ratio.ratios()

    in_place, replaced = ratios(False), ratios(True)
    assert not in_place.isnan().any() and (in_place > 0).all()
    assert torch.allclose(replaced, in_place, rtol=1e-5)


def test_weight_norms_read_over_several_phases_equal_the_exact_norms() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 7), nn.Linear(7, 400))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ws = WeightStats(GradReader.attach(model, opt), max_phases=5, min_phase_elements=1000)
    assert ws.phases == 5
    ws.begin(1, 0.0, (), 0, False)
    done = ws.advance()
    steps = 1
    while not done:
        if steps == 2:
            ws.begin(3, 0.0, (), 0, False)
        done = ws.advance()
        steps += 1
    assert steps == 5  # one phase per step, each a fifth of the elements or less
    assert [d.step for d in done] == [1] and ws.busy  # step 3's sample waits on
    assert ws.largest_phase <= -(-sum(p.numel() for p in model.parameters()) // 5)
    exact = [p.detach().norm().item() for p in model.parameters()]
    assert done[0].norms is not None
    assert done[0].norms.tolist() == pytest.approx(exact, rel=1e-5)
    (second,) = [d for _ in range(2) for d in ws.advance()]  # shares the reads since step 3
    assert second.step == 3 and not ws.busy
    assert second.norms is not None and second.norms.tolist() == pytest.approx(exact, rel=1e-5)


def test_close_finishes_an_open_round_so_the_last_sample_is_not_lost() -> None:
    model = nn.Sequential(nn.Linear(400, 400), nn.Linear(400, 400))  # over 1 phase
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = gradwatch.watch(
        model, opt, job="cost", endpoint="tcp://127.0.0.1:1", stats_every=5, early_stats=False
    )
    assert mon._wstats is not None and mon._wstats.phases > 1
    for _ in range(5):
        model(torch.randn(2, 400)).sum().backward()
        opt.step()
        mon.log(loss=1.0)
        opt.zero_grad()
    assert mon._wstats.busy  # the step-5 sample waits for the rest of its weight norms
    mon.close()
    assert not mon._wstats.busy
    assert mon.stats.stats_dropped + mon.stats.stats_sent == 1
