"""A loss below zero is no supervised loss: the loss-shape rules let go of it (rules/engine.py).

pytorch/examples' reinforce.py and actor_critic.py (benchmarks/pex_trial.py) log a
policy-gradient objective: a sum over the episode of -log p(action) x normalised return,
which crosses zero every few steps and grows with the episode's length. On those healthy
runs LossFarAboveStart paged 59 times, LossSpike and LossDiverging 28.
"""

from __future__ import annotations

import math

import numpy as np

from gradwatch.rules import Engine, Step, load_default_rules

LAYERS = ("affine1.weight", "affine1.bias", "affine2.weight", "affine2.bias")


def step(t: int, loss: float, norm: float = 10.0) -> Step:
    """One step of a 4-tensor policy: matrices at ``norm``, biases at a third of it."""
    norms = np.array([norm, norm / 3, norm, norm / 3])
    total = float(np.sqrt(np.sum(norms**2)))
    return Step("rl", t, float(t), loss=loss, layers=LAYERS, layer_norms=norms, grad_norm=total)


def policy_gradient_losses(n: int, seed: int = 0) -> list[float]:
    """A signed sum over an episode whose length grows from ~10 to 500 steps, as REINFORCE's."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(500, 10 * np.exp(np.arange(n) / 120.0))
    return [float(rng.normal(0.0, 0.8) * math.sqrt(length)) for length in lengths]


def fired(engine: Engine, steps: list[Step]) -> list[tuple[str, str, int]]:
    return [(t.alert.rule, t.current, t.alert.step) for s in steps for t in engine.observe(s)]


def test_a_policy_gradient_objective_pages_nothing_and_says_why_once() -> None:
    losses = [0.13, 2.37, 0.09, 0.08, 1.3, -1.05, 0.61] + policy_gradient_losses(600)[7:]
    engine = Engine(load_default_rules())
    steps = [step(t, loss) for t, loss in enumerate(losses, start=1)]
    transitions = [tr for s in steps for tr in engine.observe(s)]
    assert [(t.alert.rule, t.alert.severity, t.alert.step) for t in transitions] == [
        ("LossBelowZero", "info", 6)
    ]
    assert "below zero at step 6 (-1.05)" in transitions[0].alert.summary


def test_the_first_loss_below_zero_resolves_what_the_loss_rules_fired() -> None:
    engine = Engine(load_default_rules())
    rising = [step(1, 0.1), step(2, 5.0), step(3, 6.0), step(4, 7.0)]
    assert fired(engine, rising) == [("LossFarAboveStart", "firing", 3)]
    assert fired(engine, [step(5, -1.0)]) == [
        ("LossFarAboveStart", "resolved", 3),
        ("LossBelowZero", "firing", 5),
    ]
    # From then on the loss's shape is not judged on this rank, however far it goes ...
    assert fired(engine, [step(t, 50.0 * t) for t in range(6, 60)]) == []
    # ... while the rules that read gradients go on.
    bad = step(60, 1.0, norm=math.nan)
    assert [r for r, current, _ in fired(engine, [bad]) if current == "firing"] == [
        "NonFiniteGradients"
    ]


def test_a_supervised_loss_stays_judged() -> None:
    engine = Engine(load_default_rules())
    losses = [2.3] * 3 + [2.3 * 40] * 3  # never below zero: the start bound pages
    steps = [step(t, loss) for t, loss in enumerate(losses, start=1)]
    assert ("LossFarAboveStart", "firing", 5) in fired(engine, steps)


def test_a_broken_loss_dipping_under_the_bound_for_a_while_stays_one_incident() -> None:
    # pytorch/examples' regression at lr x100 hovers at 7-20x its first loss: each dip under
    # 10x resolved LossFarAboveStart and the next rise paged it again (75 times in 5,000
    # steps). A dip shorter than keep_firing_for (20 observations) is one incident.
    engine = Engine(load_default_rules())
    broken = [1.0] + [15.0] * 10 + [8.0] * 15 + [15.0] * 10  # a 15-step dip
    got = fired(engine, [step(t, loss) for t, loss in enumerate(broken, start=1)])
    assert [(rule, current) for rule, current, _ in got if rule == "LossFarAboveStart"] == [
        ("LossFarAboveStart", "firing")
    ]
    # A longer calm ends it; a new rise is a new incident.
    after = [8.0] * 30 + [15.0] * 5
    got = fired(engine, [step(t, loss) for t, loss in enumerate(after, start=len(broken) + 1)])
    assert [(rule, current) for rule, current, _ in got if rule == "LossFarAboveStart"] == [
        ("LossFarAboveStart", "resolved"),
        ("LossFarAboveStart", "firing"),
    ]
