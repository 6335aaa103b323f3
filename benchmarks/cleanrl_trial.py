"""A trial on CleanRL's ``ppo.py``: proximal policy optimisation on CartPole-v1.

What the other trials lack is PPO, the most used on-policy algorithm, in its most read
single-file form. Its loss is three objectives summed: the clipped policy surrogate (about
zero: advantages are normalised per minibatch), minus 0.01 x the policy's entropy, plus
half the value function's squared error against returns that grow as the policy learns
(CartPole pays 1 a step: a discounted return climbs from ~10 towards 100). So a healthy
run's loss can *rise* for hundreds of steps while everything is right. Per rollout of 4
envs x 128 steps: 4 epochs x 4 minibatches, 16 optimizer steps (Adam, eps 1e-5, its lr
annealed linearly to 0 over the run), grad norm clipped to 0.5, tanh MLPs with orthogonal
init; 512 forwards under ``no_grad`` between two rollouts' updates.

Run as a user would, unmodified but for gradwatch: ``watch(agent, optimizer)`` once the
optimizer exists, ``log(loss=loss)`` after ``optimizer.step()``, ``close()`` before
``envs.close()``. gymnasium, tyro and tensorboard are not installed here, so
``benchmarks/standins/`` answers the first two (a CartPole from the published dynamics,
gymnasium 0.29's vector API; a dataclass parser) and the script's one tensorboard import
is pointed at ``standins/summary_writer.py``, which keeps the scalars (the trial prints
the episodic returns from them). ``--iters`` is the number of rollouts (the script's
``num_iterations``; default 976, its 500k timesteps), 16 gradwatch steps each; DQN
runs as many timesteps (``--iters`` x 512).

The same trial runs CleanRL's ``dqn.py`` (variants ``dqn`` and ``dqn_undeclared``): a
Q-network of two ReLU layers trained every 10 env steps on replayed batches (49k Adam
steps at the default 500k timesteps) against a target network copied every 500, its
loss the TD error's MSE, which rises as the Q-values grow; its replay buffer is
CleanRL's own ``cleanrl_utils/buffers.py``.

Variants (none took part in designing a rule): ``healthy`` (the script's settings, with
``supervised_loss=False`` as README says for RL), ``undeclared`` (the same without it),
``lr_x100`` (``--learning-rate 0.025``: it solves CartPole too, so it is not scored) and
``lr_x1000`` (0.25: the policy collapses to returns of ~9.5, CartPole's floor) and
``adv_flipped`` (the advantages' sign flipped: the policy is taught to fail; not scored,
since only the returns show it and gradwatch is not sent them). Measured
2026-12-06 (seeded by the script; docs/measurements.md): healthy 416 pages before the
towers and the declaration, 32 after, 3 once the declaration also let go of vanishing
gradients, 0 since a layer's lag net of its own growth and a layer saturating over
healthy-sized updates (the critic) are no page; undeclared 263 -> 260; lr x1000
caught, its first alert at step 4 with "lower the learning rate" first. DQN (return
23 -> 498): declared 0 alerts (49 pages before its one-step-extreme rule was told the
loss is not supervised); undeclared 718; DQN at lr x100 (return 128 against 498) caught
by DeadReLUs at step 2,385 (missed while a falling
declared loss excused its dying layer).

    mkdir /tmp/cleanrl && git --git-dir=$(fetch vwxyzjn/cleanrl) archive HEAD cleanrl/ppo.py \\
        cleanrl/dqn.py cleanrl_utils/buffers.py | tar -x -C /tmp/cleanrl
    python benchmarks/cleanrl_trial.py /tmp/cleanrl --keep /tmp/trials/ppo
    python benchmarks/cleanrl_trial.py --replay-only /tmp/trials/ppo   # current rules
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, STANDINS, checkout_trial, insert_after, replace_once, run_recorded

ITERS = 976  # the script's own: 500,000 timesteps / (4 envs x 128 steps)
ROLLOUT = 4 * 128
ACCEPT: dict[str, tuple[str, ...] | None] = {
    "healthy": (),
    "undeclared": (),
    "grad_norm": (),
    "lr_x100": None,
    "lr_x1000": LR_TOO_HIGH,
    # The policy taught to fail: only the returns show it, which gradwatch is not sent.
    "adv_flipped": None,
    "dqn": (),
    "dqn_undeclared": (),
    "dqn_lr_x100": LR_TOO_HIGH,
}
HELPFUL: dict[str, tuple[str, ...]] = {
    "lr_x1000": ("learning rate", "lr"),
    "dqn_lr_x100": ("learning rate", "lr"),
}
LEARNING_RATES = {"lr_x100": "0.025", "lr_x1000": "0.25", "dqn_lr_x100": "0.025"}
PPO = "cleanrl/ppo.py"
DQN = "cleanrl/dqn.py"  # with its replay buffer, cleanrl_utils/buffers.py


# Each script's line that builds its optimizer, and the model it optimizes.
OPTIMIZERS = {
    PPO: ("optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)", "agent"),
    DQN: ("optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)", "q_network"),
}


def patch(
    text: str,
    job: str,
    endpoint: str,
    where: str = PPO,
    declared: bool = True,
    grad_norm: bool = False,
) -> str:
    """``ppo.py`` or ``dqn.py`` with gradwatch attached as README's quickstart says (for
    RL: ``supervised_loss=False``, unless not ``declared``; with ``grad_norm``, PPO's
    pre-clip norm logged as README suggests), and the stand-in writer in place of
    tensorboard's."""
    t = replace_once(
        text,
        "from torch.utils.tensorboard import SummaryWriter\n",
        "from summary_writer import SummaryWriter  # gradwatch trial: no tensorboard here\n",
        where,
    )
    line, model = OPTIMIZERS[where]
    t = insert_after(
        t,
        f"    {line}\n",
        "    import gradwatch\n"
        f"    mon = gradwatch.watch({model}, optimizer, job={job!r}, endpoint={endpoint!r}"
        + (", supervised_loss=False)\n" if declared else ")\n"),
        where,
    )
    logged = "loss=loss"
    if grad_norm:
        clip = "                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)\n"
        t = replace_once(t, clip, clip.replace("nn.utils", "grad_norm = nn.utils"), where)
        logged += ", grad_norm=grad_norm"
    t = insert_after(
        t, "                optimizer.step()\n", f"                mon.log({logged})\n", where
    )
    return replace_once(t, "    envs.close()\n", "    mon.close()\n    envs.close()\n", where)


def returns(vdir: Path) -> list[float]:
    """The episodic returns the script wrote, in order."""
    path = vdir / "scalars.jsonl"
    if not path.exists():
        return []
    rows = (json.loads(line) for line in path.read_text(encoding="utf8").splitlines())
    return [r["value"] for r in rows if r["tag"] == "charts/episodic_return"]


def run_variant(root: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    (vdir / "cleanrl").mkdir(parents=True, exist_ok=True)
    job = f"cleanrl-{variant}"
    where = DQN if variant.startswith("dqn") else PPO
    if where == DQN:
        (vdir / "cleanrl_utils").mkdir(exist_ok=True)
        buffers = "cleanrl_utils/buffers.py"
        (vdir / buffers).write_text((root / buffers).read_text(encoding="utf8"))

    def write(endpoint: str) -> list[str]:
        text = (root / where).read_text(encoding="utf8")
        declared = not variant.endswith("undeclared")
        gn = variant == "grad_norm"
        text = patch(text, job, endpoint, where, declared, gn)
        if variant == "adv_flipped":
            line = "                mb_advantages = b_advantages[mb_inds]\n"
            text = replace_once(text, line, line.replace("= b_", "= -b_"), where)
        (vdir / where).write_text(text)
        args = [where, "--total-timesteps", str(iters * ROLLOUT)]
        if variant in LEARNING_RATES:
            args += ["--learning-rate", LEARNING_RATES[variant]]
        return args

    # The script's own folder first (its cleanrl_utils), as when it runs from its checkout.
    path = f"{vdir}{os.pathsep}{STANDINS}"
    trace = run_recorded(work, traces, job, vdir, write, {"PYTHONPATH": path})
    got = returns(vdir)
    if got:
        tenth = max(1, len(got) // 10)
        first, last = got[:tenth], got[-tenth:]
        print(
            f"[{job}] {len(got)} episodes; mean return of the first tenth "
            f"{sum(first) / len(first):.1f}, of the last {sum(last) / len(last):.1f} "
            "(CartPole-v1 is solved at 475)",
            file=sys.stderr,
        )
    return trace


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "cleanrl", PPO, (ACCEPT, HELPFUL), ITERS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
