"""Multi-rank assembly: exact global norms from shards, deadlines, order, blame."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

from gradwatch.rules import Engine, load_default_rules
from gradwatch.rules.assembly import Assembler, assembles
from gradwatch.rules.step import Stats, Step

LAYERS = ("a", "b", "c")


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def report(
    step: int,
    rank: int,
    norms: tuple[float, ...],
    *,
    world: int,
    shards: int,
    loss: float = 1.0,
    time: float | None = None,
    layers: tuple[str, ...] = LAYERS,
) -> Step:
    values = np.array(norms, np.float64)
    return Step(
        job="j",
        step=step,
        time=float(step) if time is None else time,
        rank=rank,
        loss=loss,
        grad_norm=float(np.sqrt(np.square(values).sum())),
        layers=layers,
        layer_norms=values,
        lr=(0.1,),
        world=world,
        shards=shards,
    )


def test_only_declared_multi_rank_jobs_are_assembled() -> None:
    assert assembles(report(1, 0, (1, 1, 1), world=4, shards=4))
    assert not assembles(report(1, 0, (1, 1, 1), world=4, shards=0))  # an older agent
    assert not assembles(report(1, 0, (1, 1, 1), world=1, shards=1))


def test_fsdp_shards_add_as_sums_of_squares_in_step_order() -> None:
    rng = np.random.default_rng(0)
    shards = rng.uniform(0.1, 3.0, size=(2, 4, 3))  # (step, rank, layer)
    asm = Assembler(clock=FakeClock())
    out: list[Step] = []
    # Arrival order across ranks and steps is arbitrary (batches of different ranks).
    for s, r in [(0, 3), (1, 0), (0, 0), (1, 1), (0, 1), (1, 3), (1, 2), (0, 2)]:
        out += asm.add(report(s + 1, r, tuple(shards[s, r]), world=4, shards=4, loss=float(r)))
    assert [w.step for w in out] == [1, 2]  # step 2 was whole first, and waited for step 1
    for whole, s in zip(out, range(2), strict=True):
        expected = np.sqrt(np.square(shards[s]).sum(axis=0))
        np.testing.assert_allclose(whole.layer_norms, expected, rtol=1e-12)
        assert whole.layers == LAYERS and whole.assembled == 4
        assert whole.grad_norm == pytest.approx(float(np.sqrt(np.square(shards[s]).sum())))
        assert whole.loss == pytest.approx(1.5)  # the mean of the ranks' own losses
        assert not any(np.allclose(whole.layer_norms, shards[s, r]) for r in range(4))


def test_a_later_complete_step_waits_for_an_earlier_one() -> None:
    asm = Assembler(clock=FakeClock())
    assert asm.add(report(1, 0, (1, 1, 1), world=2, shards=2)) == []
    assert asm.add(report(2, 0, (1, 1, 1), world=2, shards=2)) == []
    assert asm.add(report(2, 1, (1, 1, 1), world=2, shards=2)) == []  # whole, but step 1 is not
    out = asm.add(report(1, 1, (1, 1, 1), world=2, shards=2))
    assert [w.step for w in out] == [1, 2]


def test_ddp_needs_one_report_per_replica_and_waits_for_every_rank_it_knows() -> None:
    asm = Assembler(clock=FakeClock())
    norms = (0.5, 2.0, 1.5)
    # The first step waits for the whole world (agents connect at different times).
    assert asm.add(report(1, 1, norms, world=3, shards=1)) == []
    assert asm.add(report(1, 0, norms, world=3, shards=1)) == []
    (whole,) = asm.add(report(1, 2, norms, world=3, shards=1))
    np.testing.assert_allclose(whole.layer_norms, norms)  # replicas are not added up
    assert whole.rank == 0 and whole.assembled == 3
    # Later steps wait for every rank heard from.
    assert asm.add(report(2, 2, norms, world=3, shards=1)) == []
    assert asm.add(report(2, 0, norms, world=3, shards=1)) == []
    assert [w.assembled for w in asm.add(report(2, 1, norms, world=3, shards=1))] == [3]


def test_an_agent_on_one_rank_of_a_ddp_job_waits_once_then_is_judged_at_once() -> None:
    clock = FakeClock()
    asm = Assembler(deadline_seconds=5.0, clock=clock)
    assert asm.add(report(1, 0, (1, 1, 1), world=8, shards=1)) == []
    clock.now += 5.0
    assert [w.step for w in asm.expire()] == [1]
    out = [w for n in range(2, 6) for w in asm.add(report(n, 0, (1, 1, 1), world=8, shards=1))]
    assert [w.step for w in out] == [2, 3, 4, 5]
    # Ranks never heard from are not running an agent: not "absent".
    assert asm.absent("j") == set() and asm.counts()["j"].incomplete == 1


def test_a_missing_rank_is_waited_for_until_the_deadline_then_not_any_more() -> None:
    clock = FakeClock()
    asm = Assembler(deadline_seconds=5.0, clock=clock)
    for r in range(3):
        asm.heard("j", r)  # every rank's agent heartbeats
    asm.add(report(1, 0, (3.0, 4.0, 1.0), world=3, shards=3))
    asm.add(report(1, 1, (4.0, 3.0, 1.0), world=3, shards=3))
    assert asm.expire() == []
    clock.now += 5.0
    (whole,) = asm.expire()
    # Rank 2's shard never came: a partial sum would look like vanishing gradients.
    assert whole.layers == () and whole.grad_norm is None and whole.assembled == 2
    assert asm.absent("j") == {2}
    assert asm.counts()["j"].incomplete == 1 and asm.counts()["j"].inexact == 1
    # The next step does not wait for the absent rank again...
    asm.add(report(2, 0, (1.0, 1.0, 1.0), world=3, shards=3))
    (nxt,) = asm.add(report(2, 1, (1.0, 1.0, 1.0), world=3, shards=3))
    assert nxt.step == 2 and nxt.layers == ()
    # ...and a rank that reports a step still being assembled is expected again.
    asm.add(report(3, 2, (1.0, 1.0, 1.0), world=3, shards=3))
    assert asm.absent("j") == set()
    asm.add(report(3, 0, (1.0, 1.0, 1.0), world=3, shards=3))
    (back,) = asm.add(report(3, 1, (1.0, 1.0, 1.0), world=3, shards=3))
    assert back.layers == LAYERS and back.assembled == 3


def test_a_nonfinite_shard_is_kept_even_when_the_step_is_incomplete() -> None:
    clock = FakeClock()
    asm = Assembler(deadline_seconds=1.0, clock=clock)
    asm.add(report(1, 0, (1.0, math.nan, 1.0), world=2, shards=2))
    clock.now += 1.0
    (whole,) = asm.expire()
    assert whole.layers == ("b",) and math.isnan(whole.layer_norms[0])
    assert whole.blame == {"b": 0}


def test_blame_names_the_rank_that_went_nonfinite_first_through_the_incident() -> None:
    asm = Assembler(clock=FakeClock())
    nan = math.nan

    def step(n: int, per_rank: dict[int, tuple[float, ...]], times: dict[int, float]) -> Step:
        out: list[Step] = []
        for r in (0, 1, 2, 3):
            out += asm.add(
                report(
                    n,
                    r,
                    per_rank.get(r, (1.0, 1.0, 1.0)),
                    world=4,
                    shards=4,
                    time=times.get(r, float(n)),
                )
            )
        (whole,) = out
        return whole

    assert step(1, {}, {}).blame == {}
    # Step 2: ranks 2 and 0 hold a NaN in "b"; rank 2's agent got there first.
    whole = step(2, {0: (1.0, nan, 1.0), 2: (1.0, nan, 1.0)}, {0: 2.5, 2: 2.1})
    assert whole.blame == {"b": 2}
    # Step 3: everything is NaN now; "b" keeps its first culprit, "a" gets its own.
    whole = step(3, dict.fromkeys(range(4), (nan, nan, nan)), {1: 2.9})
    assert whole.blame == {"a": 1, "b": 2, "c": 1}
    assert step(4, {}, {}).blame == {}  # a clean step ends the incident
    whole = step(5, {3: (1.0, nan, 1.0)}, {})
    assert whole.blame == {"b": 3}


def test_engine_alert_names_the_first_bad_rank_and_layer() -> None:
    asm = Assembler(clock=FakeClock())
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    fired = []
    for n in range(1, 4):
        for r in range(4):
            norms = (1.0, math.nan, 1.0) if (n == 3 and r == 2) else (1.0, 1.0, 1.0)
            for whole in asm.add(report(n, r, norms, world=4, shards=4)):
                fired += [t.alert for t in engine.observe(whole) if t.current == "firing"]
    (alert,) = [a for a in fired if a.rule == "NonFiniteGradients"]
    assert alert.rank == 2 and alert.evidence["first_nonfinite"] == ["b"]
    assert "first on rank 2, b" in alert.summary
    assert engine.jobs() == ["j"]
    # Rules ran once per assembled step (job-wide), not per rank.
    assert {a.rank for a in engine.firing()} == {2}


def test_hybrid_sharding_adds_one_replica_per_shard() -> None:
    asm = Assembler(clock=FakeClock())
    out: list[Step] = []
    # world 4 = 2 replicas x 2 shards: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
    for r, norms in [
        (0, (3.0, 0.0, 1.0)),
        (1, (4.0, 2.0, 1.0)),
        (2, (3.0, 0.0, 1.0)),
        (3, (4.0, 2.0, 1.0)),
    ]:
        out += asm.add(report(1, r, norms, world=4, shards=2))
    (whole,) = out
    np.testing.assert_allclose(whole.layer_norms, [5.0, 2.0, math.sqrt(2)])


def test_late_reports_are_counted_and_a_rank_going_back_restarts_assembly() -> None:
    clock = FakeClock()
    asm = Assembler(deadline_seconds=1.0, clock=clock)
    asm.add(report(10, 0, (1, 1, 1), world=2, shards=2))
    clock.now += 1.0
    assert [w.step for w in asm.expire()] == [10]
    assert asm.add(report(10, 1, (1, 1, 1), world=2, shards=2)) == []
    assert asm.counts()["j"].late == 1
    # Rank 0 resumes from a checkpoint at step 4: assembly starts over from there.
    asm.add(report(5, 0, (1, 1, 1), world=2, shards=2))
    (whole,) = asm.add(report(5, 1, (1, 1, 1), world=2, shards=2))
    assert whole.step == 5 and asm.counts()["j"].restarts == 1


def test_pending_steps_are_bounded_per_job() -> None:
    asm = Assembler(deadline_seconds=1e9, clock=FakeClock())
    out: list[Step] = []
    for n in range(1, 300):
        out += asm.add(report(n, 0, (1, 1, 1), world=2, shards=2))
    # Past the bound the oldest step goes out as is; rank 1 was never heard from,
    # so from then on nothing waits for it.
    assert [w.step for w in out] == list(range(1, 300))
    assert asm.absent("j") == set() and asm.counts()["j"].incomplete == 1


def assembled_sample(w: np.ndarray, ratio: np.ndarray) -> Stats:
    """One cadence sample of two FSDP shards, weight norms and ratios by (rank, layer)."""
    asm = Assembler(clock=FakeClock())
    out = []
    for r in (0, 1):
        out += asm.add(
            Stats(
                job="j",
                step=50,
                time=1.0,
                rank=r,
                layers=("a", "b"),
                weight_norms=w[r],
                update_ratios=ratio[r],
                world=2,
                shards=2,
            )
        )
    (whole,) = out
    assert isinstance(whole, Stats)
    return whole


def test_stats_weights_and_update_ratios_assemble_across_shards() -> None:
    w = np.array([[3.0, 1.0], [4.0, 1.0]])  # (rank, layer) weight norms
    ratio = np.array([[0.1, 0.2], [0.2, 0.2]])
    whole = assembled_sample(w, ratio)
    np.testing.assert_allclose(whole.weight_norms, [5.0, math.sqrt(2)])
    dw = np.sqrt(((ratio * w) ** 2).sum(axis=0))
    np.testing.assert_allclose(whole.update_ratios, dw / whole.weight_norms)
    assert whole.assembled == 2


def test_an_unmeasured_ratio_beside_an_infinite_weight_warns_nothing() -> None:
    # pytorch/examples' DDP tutorial at lr 1.0 (benchmarks/ddp_trial.py) diverged to
    # infinite weights; a rank's unmeasured (NaN) ratio times inf printed a numpy
    # RuntimeWarning on the collector's stderr.
    w = np.array([[math.inf, 1.0], [1.0, 1.0]])
    ratio = np.array([[math.nan, 0.1], [0.2, 0.1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = assembled_sample(w, ratio)
    assert whole.weight_norms is not None and math.isinf(whole.weight_norms[0])
    assert whole.update_ratios is not None
    assert math.isnan(whole.update_ratios[0])  # one shard did not measure it: not measured
    np.testing.assert_allclose(whole.update_ratios[1], 0.1)


def test_a_recorded_multi_rank_trace_replays_assembled(tmp_path) -> None:
    from gradwatch.collector.recorder import TraceRecorder
    from gradwatch.rules.replay import Replay

    recorder = TraceRecorder(tmp_path)
    for n in range(1, 9):
        for r in range(4):
            norms = (1.0, math.nan, 1.0) if (n >= 5 and r == 3) else (1.0, 0.5, 2.0)
            recorder.step(report(n, r, norms, world=4, shards=4, time=100.0 + n))
    recorder.close()
    (trace,) = tmp_path.glob("*.jsonl")
    header = trace.read_text().splitlines()[0]
    assert '"world":4' in header.replace(" ", "") and '"shards":4' in header.replace(" ", "")
    run = Replay(load_default_rules())
    fired = [t.alert for t in run.run(trace) if t.current == "firing"]
    (alert,) = [a for a in fired if a.rule == "NonFiniteGradients"]
    # Judged once per assembled step, as the collector did: rank 3 named, step 5.
    assert (alert.rank, alert.step) == (3, 5) and "first on rank 3, b" in alert.summary
    assert len([a for a in fired if a.rule == "NonFiniteGradients"]) == 1


def test_ranks_that_heartbeat_are_waited_for_from_the_first_step() -> None:
    asm = Assembler(clock=FakeClock())
    for r in range(3):
        asm.heard("j", r)  # agents heartbeat before their first step
    assert asm.add(report(1, 0, (1, 1, 1), world=3, shards=1)) == []
    assert asm.add(report(1, 2, (1, 1, 1), world=3, shards=1)) == []
    (whole,) = asm.add(report(1, 1, (1, 1, 1), world=3, shards=1))
    assert whole.assembled == 3


def test_a_replica_that_goes_nonfinite_alone_is_not_hidden_by_the_others() -> None:
    # DDP replicas hold the same gradient, unless one device goes bad on its own.
    for order in ([0, 1, 2, 3], [2, 0, 1, 3]):
        asm = Assembler(clock=FakeClock())
        out: list[Step] = []
        for r in order:
            norms = (math.nan, 1.0, 1.0) if r == 2 else (1.0, 1.0, 1.0)
            out += asm.add(report(5, r, norms, world=4, shards=1))
        (whole,) = out
        assert math.isnan(whole.layer_norms[0]) and whole.layer_norms[1:].tolist() == [1.0, 1.0]
        assert whole.blame == {"a": 2}


def test_a_late_nonfinite_report_is_judged_not_dropped() -> None:
    clock = FakeClock()
    asm = Assembler(deadline_seconds=1.0, clock=clock)
    engine = Engine(load_default_rules(), clock=lambda: 0.0)
    for r in range(3):
        asm.heard("j", r)
    asm.add(report(7, 0, (1.0, 1.0, 1.0), world=3, shards=3))
    asm.add(report(7, 1, (1.0, 1.0, 1.0), world=3, shards=3))
    clock.now += 1.0
    for whole in asm.expire():
        engine.observe(whole)
    (late,) = asm.add(report(7, 2, (1.0, math.inf, 1.0), world=3, shards=3, loss=2.0))
    assert late.layers == ("b",) and late.loss is None and late.blame == {"b": 2}
    fired = [t.alert for t in engine.observe(late) if t.current == "firing"]
    assert [(a.rule, a.rank) for a in fired] == [("NonFiniteGradients", 2)]
    assert asm.add(report(7, 2, (1.0, 1.0, 1.0), world=3, shards=3)) == []  # finite: dropped


def test_a_huge_claimed_world_is_waited_for_once_then_judged_on_the_ranks_that_report() -> None:
    clock = FakeClock()
    asm = Assembler(deadline_seconds=1.0, clock=clock)
    world = 1 << 20  # the wire's largest: one (hostile or misconfigured) rank claims it
    asm.add(report(1, 0, (1, 1, 1), world=world, shards=world))
    clock.now += 1.0
    assert [w.step for w in asm.expire()] == [1]  # the first step waited its deadline once
    out = [
        w
        for n in range(2, 202)
        for w in asm.add(report(n, 0, (1, 1, 1), world=world, shards=world))
    ]
    # Each at once: nothing waits for a million ranks that never spoke (_complete
    # looks at the ranks heard from and the absent ones, never at range(world)).
    assert [w.step for w in out] == list(range(2, 202))
    assert asm.absent("j") == set()
