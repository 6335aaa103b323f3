"""What a census tells the rules about the whole job: the model's towers (the layer ratio is
taken within one) and a loss the job declared no supervised loss (rules/engine.py).

CleanRL's PPO (benchmarks/cleanrl_trial.py) trains a critic and an actor side by side in
one module, and logs their summed loss, whose value part grows with the returns. On its
healthy run that solves CartPole the rules paged 416 times: the first/last layer ratio
across the two networks (182), the loss-shape rules on a loss that rises as it should.
"""

from __future__ import annotations

import numpy as np

from gradwatch.rules import Engine, Step, load_default_rules
from gradwatch.rules.step import ActStats, Stats
from gradwatch.wire.census import Census

LAYERS = (
    "critic.0.weight",
    "critic.0.bias",
    "critic.2.weight",
    "critic.2.bias",
    "actor.0.weight",
    "actor.0.bias",
    "actor.2.weight",
    "actor.2.bias",
)
ROLES = ("weight", "bias") * 4
TOWERS = (0, 0, 0, 0, 1, 1, 1, 1)


def census(towers: tuple[int, ...] = TOWERS, supervised: bool = True) -> Census:
    return Census(
        params_total=100,
        params_trainable=100,
        params_frozen=0,
        params_not_in_optimizer=0,
        towers=towers,
        supervised_loss=supervised,
    )


def stats(t: int, c: Census) -> Stats:
    return Stats(job="ppo", step=t, time=float(t), layers=LAYERS, census=c)


def step(t: int, critic: tuple[float, float], actor: float = 0.05, loss: float = 20.0) -> Step:
    norms = np.array([critic[0], 0.1, critic[1], 0.1, actor, 0.01, actor, 0.01])
    return Step(
        "ppo",
        t,
        float(t),
        loss=loss,
        layers=LAYERS,
        layer_norms=norms,
        grad_norm=float(np.sqrt(np.sum(norms**2))),
        layer_roles=ROLES,
    )


def firing(engine: Engine, records: list[Step | Stats]) -> list[tuple[str, int]]:
    out = []
    for r in records:
        got = engine.observe(r) if isinstance(r, Step) else engine.observe_stats(r)
        out += [(t.alert.rule, t.alert.step) for t in got if t.current == "firing"]
    return out


def value_scale(t: int) -> float:
    """The critic's gradients as the returns grow: x1000 over 600 steps, both its layers."""
    return 0.05 * 1000.0 ** (t / 600)


def test_the_ratio_across_an_actor_and_a_critic_pages_without_the_towers_only() -> None:
    steps = [step(t, (value_scale(t), value_scale(t))) for t in range(1, 601)]
    blind = [rule for rule, _ in firing(Engine(load_default_rules()), list(steps))]
    assert "LayerGradNormRatioExploding" in blind  # critic.0 over actor.2: no path
    told = firing(Engine(load_default_rules()), [stats(1, census()), *steps])
    assert not [rule for rule, _ in told if rule.startswith("LayerGradNormRatio")]


def test_gradients_exploding_through_one_tower_still_page() -> None:
    # Within the critic, its first layer's gradient grows x1000 over its last's.
    steps = [step(t, (value_scale(t), 0.05)) for t in range(1, 601)]
    told = firing(Engine(load_default_rules()), [stats(1, census()), *steps])
    assert "LayerGradNormRatioExploding" in [rule for rule, _ in told]


def test_a_loss_declared_unsupervised_is_not_judged_by_its_shape() -> None:
    rising = [step(t, (0.05, 0.05), loss=20.0 * 1.01**t) for t in range(1, 401)]
    judged = [rule for rule, _ in firing(Engine(load_default_rules()), list(rising))]
    assert {"LossDiverging", "LossFarAboveStart"} & set(judged)
    declared = firing(Engine(load_default_rules()), [stats(1, census(supervised=False)), *rising])
    assert declared == []
    # Declared mid-run (a census arrives later): what the loss rules fired resolves.
    engine = Engine(load_default_rules())
    before = firing(engine, list(rising[:300]))
    assert before
    resolved = [
        t.alert.rule
        for t in engine.observe_stats(stats(301, census(supervised=False)))
        if t.current == "resolved"
    ]
    assert set(resolved) == {rule for rule, _ in before}
    assert firing(engine, list(rising[300:])) == []


def test_towers_and_the_declaration_reach_ranks_that_report_later() -> None:
    # A rank seen for the first time after the census: its detectors start told.
    engine = Engine(load_default_rules())
    firing(engine, [stats(1, census(supervised=False))])
    steps = [step(t, (value_scale(t), value_scale(t)), loss=20.0 * 1.01**t) for t in range(1, 601)]
    assert firing(engine, list(steps)) == []


def test_a_declared_loss_keeps_only_the_grad_norm_in_the_one_step_extreme() -> None:
    # CleanRL's DQN on CartPole: its TD loss jumps 250-670x its running median in bursts
    # while the run learns; its gradient norm is still judged, so a corrupt batch's
    # gradient still pages.
    def dqn(t: int, loss: float, norm: float = 1.0) -> Step:
        norms = np.array([norm, 0.1, norm, 0.1, norm, 0.1, norm, 0.1])
        return Step("ppo", t, float(t), loss=loss, layers=LAYERS, layer_norms=norms)

    quiet = [dqn(t, 0.2) for t in range(1, 200)]
    jump = dqn(200, 80.0)
    judged = firing(Engine(load_default_rules()), [*quiet, jump])
    assert ("LossExtremeStep", 200) in judged
    engine = Engine(load_default_rules())
    assert firing(engine, [stats(1, census((), supervised=False)), *quiet, jump]) == []
    corrupt = dqn(201, 0.2, norm=500.0)
    assert ("LossExtremeStep", 201) in firing(engine, [corrupt])


def test_weights_grown_from_their_init_say_nothing_of_it_when_the_loss_is_declared() -> None:
    # A value function's weights grow with the returns it regresses (CleanRL's DQN at lr
    # x100: x38 from a standard init); WeightsStartedTooSmall's reading, "the init was too
    # small", assumes fixed targets. Undeclared, the same samples raise it.
    def waking(t: int) -> float:
        return 1.0 - 0.98 * np.exp(-t / 30.0)

    def run(declared: bool) -> list[str]:
        engine = Engine(load_default_rules())
        records: list[Step | Stats] = []
        if declared:
            records.append(stats(1, census((), supervised=False)))
        for t in range(1, 201):
            grad = 0.01 if t <= 3 else 1.0
            records.append(step(t, (grad, grad), actor=grad, loss=1.0))
            if t == 1 or t % 25 == 0:
                norms = np.array([waking(t), 0.01] * 4)
                records.append(
                    Stats(job="ppo", step=t, time=float(t), layers=LAYERS, weight_norms=norms)
                )
        return [rule for rule, _ in firing(engine, records)]

    assert "WeightsStartedTooSmall" in run(declared=False)
    assert "WeightsStartedTooSmall" not in run(declared=True)


def test_a_declared_loss_lets_go_of_vanishing_gradients_only() -> None:
    # CleanRL's PPO: as the returns grow, its critic's tanh units saturate and its first
    # layer's gradient falls from 1:1.4 to 1:1,150 of its last's in a run that solves
    # CartPole. Undeclared (a supervised loss) the same ratio pages; declared it does not,
    # while the exploding direction is still judged within the tower.
    fading = [step(t, (0.0025 / value_scale(t), 0.05), loss=20.0) for t in range(1, 601)]
    undeclared = firing(Engine(load_default_rules()), [stats(1, census()), *fading])
    assert "LayerGradNormRatioVanishing" in [rule for rule, _ in undeclared]
    declared = firing(Engine(load_default_rules()), [stats(1, census(supervised=False)), *fading])
    assert "LayerGradNormRatioVanishing" not in [rule for rule, _ in declared]

    # Nor is the ratio named as a later alert's earlier cause (the diagnosis's history).
    def cause_after(declared: bool) -> str:
        engine = Engine(load_default_rules())
        firing(engine, [stats(1, census(supervised=not declared)), *fading])
        zero = [
            Step("ppo", t, float(t), loss=20.0, layers=LAYERS, layer_norms=np.zeros(8))
            for t in range(601, 606)
        ]
        fired = [t.alert for r in zero for t in engine.observe(r) if t.current == "firing"]
        alert = next(a for a in fired if a.rule == "GradientsAllZero")
        assert alert.diagnosis is not None
        return str(alert.diagnosis["earlier_cause"])

    assert "layer grad-norm ratio" in cause_after(declared=False)
    assert "layer grad-norm ratio" not in cause_after(declared=True)
    growing = [step(t, (value_scale(t), 0.05), loss=20.0) for t in range(1, 601)]
    told = firing(Engine(load_default_rules()), [stats(1, census(supervised=False)), *growing])
    assert "LayerGradNormRatioExploding" in [rule for rule, _ in told]


def test_dying_relus_are_not_excused_by_a_declared_loss_that_falls() -> None:
    # CleanRL's DQN at lr x100: 97-99% of its first ReLU layer's outputs are zero while its
    # TD loss falls, and the return ends at 128 (healthy: 498). A supervised loss falling
    # as a layer turns sparse excuses the layer; a declared one says nothing of learning.
    def run(declared: bool) -> list[str]:
        records: list[Step | Stats] = []
        if declared:
            records.append(stats(1, census((), supervised=False)))
        for t in range(1, 401):
            records.append(step(t, (0.05, 0.05), loss=20.0 * 0.98**t))
            if t % 50 == 0:
                zero = 0.5 if t < 200 else 0.97
                act = (ActStats("network.1", "relu", 0.1, 0.2, zero_frac=zero),)
                records.append(Stats(job="ppo", step=t, time=float(t), layers=LAYERS, act=act))
        return [rule for rule, _ in firing(Engine(load_default_rules()), records)]

    assert "DeadReLUs" not in run(declared=False)
    assert "DeadReLUs" in run(declared=True)
