"""The seed's worked example, run for real: what happens, and what gradwatch says.

A 6-layer tanh MLP classifier, Xavier init scaled 10x, SGD at lr 0.1, a
hand-written log-softmax; Stage 1 memorizes 12 examples for 300 steps, then the
run continues on the full set. The same run with the correct init is the fix.
Prints, per init: the memorization ratio (seed: loss must fall below 1e-3 of
its start), the loss at marked steps, the first/last layer grad-norm ratio, the
tanh saturated share, whether any loss went non-finite, and the alerts (with
their diagnosis) that gradwatch raised through the real agent -> collector path.

    python benchmarks/seed_example.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from scenarios.scenario_lib import BY_NAME, run_scenario
from torch import nn

from gradwatch import seed_example
from gradwatch.seed_example import SUBSET_STEPS as SEED_STEPS

MARKS = (1, 20, 40, 100, 300, 301, 350, 450, 600)


class Probe:
    """Layer grad norms (at each optimizer step) and tanh saturation of one run."""

    def __init__(self) -> None:
        self.ratio: dict[int, float] = {}
        self.saturated: dict[int, float] = {}
        self.step = 0

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """``seed_example.run``'s watch hook: probe instead of a gradwatch Monitor."""
        lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
        optimizer.register_step_pre_hook(lambda *_: self._grads(lins))
        for module in model.modules():
            if isinstance(module, nn.Tanh):
                module.register_forward_hook(self._saturation)

    def _grads(self, lins: list[nn.Linear]) -> None:
        self.step += 1
        first, last = (float(lins[i].weight.grad.norm()) for i in (0, -1))
        self.ratio[self.step] = first / last if last > 0 else math.inf

    def _saturation(self, module: nn.Module, inputs: object, out: torch.Tensor) -> None:
        share = float((out.detach().abs() > 0.99).float().mean())
        step = self.step + 1  # the forward of the step about to be taken
        self.saturated[step] = max(self.saturated.get(step, 0.0), share)


def measure(init_scale: float) -> tuple[list[float], Probe]:
    probe = Probe()
    torch.manual_seed(0)
    x, y = seed_example.tabular()
    losses = seed_example.run(seed_example.seed_model(init_scale), x, y, probe.watch)
    return losses, probe


def main() -> int:
    torch.set_num_threads(1)
    for scale, scenario in (
        (10.0, "seed_example_xavier_x10"),
        (1.0, "healthy_seed_example_fixed_init"),
    ):
        losses, probe = measure(scale)
        ratio = losses[SEED_STEPS - 1] / losses[0]
        print(
            f"== Xavier x{scale:g}: memorization {'PASSES' if ratio < 1e-3 else 'FAILS'} "
            f"(loss {losses[0]:.3g} -> {losses[SEED_STEPS - 1]:.3g}, ratio {ratio:.2g}; "
            f"seed's bar 1e-3); non-finite loss: "
            f"{next((i + 1 for i, v in enumerate(losses) if not math.isfinite(v)), 'never')}"
        )
        print(f"{'step':>6}{'loss':>12}{'|g1|/|g6|':>12}{'tanh sat':>10}")
        for s in MARKS:
            print(
                f"{s:>6}{losses[s - 1]:>12.4g}{probe.ratio.get(s, math.nan):>12.3g}"
                f"{probe.saturated.get(s, math.nan):>10.2f}"
            )
        result = run_scenario(BY_NAME[scenario])
        if not result.alerts:
            print("gradwatch: no alert")
        for alert in result.alerts:
            diagnosis = alert.diagnosis or {}
            print(
                f"gradwatch: {alert.rule} [{alert.category}] from step {alert.step}: "
                f"{alert.summary}\n  diagnosis: {diagnosis.get('summary', '')}\n  next checks: "
                + "; ".join(diagnosis.get("next_checks", ())[:4])
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
