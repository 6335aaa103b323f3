"""A trial on cloneofsimo/minDiffusion's ``superminddpm.py``: a denoising diffusion model.

What the other trials lack is a diffusion objective: each batch draws its own noise
level ``t`` (uniform over 1,000 steps) and its own noise, and the model predicts the
noise by MSE. The loss of a batch depends on the noise levels it drew as much as on the
model, so a healthy run's loss is noisy from batch to batch around a floor it never
leaves (this script's model does not even see ``t``). Conv 7x7 layers with BatchNorm and
LeakyReLU, Adam at lr 2e-4, batch 128, the script's own DDPM schedule.

Run the way a CPU user would, changing only what the machine forces: the channel widths
are divided by ``WIDTH_DIVISOR`` (64..512 become 8..64; at full width one step takes
~14 s here), the DataLoader runs in this process, ``cpu`` replaces ``cuda:0``, one epoch
is bounded to ``--iters`` batches, and the end-of-epoch sampling (1,000 denoising passes)
is skipped. torchvision is not installed here, so ``benchmarks/standins/`` answers it
with synthetic digits in MNIST's shape.

gradwatch is attached as README's quickstart says: ``watch(ddpm, optim)`` once the
optimizer exists, ``log(loss=loss)`` after ``optim.step()``, ``close()`` at the end.
Variants: ``healthy`` (the script's settings) and ``lr_x100`` (Adam at 2e-2). Neither
took part in designing a rule. Measured 2026-12-06 (400 batches, two runs of each; the
script draws unseeded): healthy 0 alerts both times, its loss 0.09-0.095 by the end. At lr
x100 Adam's first update alone inflates the conv weights x2.4 (every element moves by about
the lr) and they reach x8 of their start by step ~60, BatchNorm keeping the outputs in
range; the loss then sits at 1.0, the trivial predictor's MSE, for the first 200 steps in
one run and 100 in the other, and both end *below* the healthy run (0.055-0.062). So it is
not scored: shown, as ``gcn``'s lr x100 in pex_trial.py. What the first run showed: the
agent's first sample read the weights after the first update, and WeightsInflatingLoss-
Stalled dropped its history when the layer roles arrived, so the growth from the start was
invisible; with both fixed (agent/weightstats.py: read_initial; rules/inflation.py) the
200-step plateau pages at step 97 ("lower the learning rate", its init spliced in from the
second run: ``/tmp/trials/ddpm_splice``), and the 100-step one, which was falling again by
then, raises nothing. Live, ``--seed 1`` sits at the trivial loss for 200 steps and pages
at step 97; ``--seed 2`` learns by step ~100 and raises nothing.

    mkdir /tmp/mindiff && git --git-dir=$(fetch cloneofsimo/minDiffusion) archive HEAD \\
        superminddpm.py | tar -x -C /tmp/mindiff
    python benchmarks/ddpm_trial.py /tmp/mindiff --keep /tmp/trials/ddpm
    python benchmarks/ddpm_trial.py /tmp/mindiff --seed 1 --variants lr_x100 --iters 250
    python benchmarks/ddpm_trial.py --replay-only /tmp/trials/ddpm   # current rules
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

from trials import STANDINS, checkout_trial, insert_after, replace_once, run_recorded

ITERS = 400
WIDTH_DIVISOR = 8
# lr x100 ends below the healthy loss after a plateau of random length: not scored.
ACCEPT: dict[str, tuple[str, ...] | None] = {"healthy": (), "lr_x100": None}
HELPFUL: dict[str, tuple[str, ...]] = {}
WHERE = "superminddpm.py"


def _narrow(match: re.Match[str]) -> str:
    """One ``blk(a, b)`` or ``nn.Conv2d(a, ...`` with its literal widths divided."""
    args = [
        str(int(a) // WIDTH_DIVISOR) if a.strip().isdigit() else a
        for a in match.group(2).split(", ")
    ]
    return f"{match.group(1)}({', '.join(args)}"


def patch(
    text: str, job: str, endpoint: str, iters: int, broken: bool, seed: int | None = None
) -> str:
    """``superminddpm.py`` with gradwatch attached as README's quickstart says; ``seed``:
    its draws seeded (the script seeds nothing)."""
    start, end = text.index("class DummyEpsModel"), text.index("class DDPM")
    model = re.sub(r"(blk|nn\.Conv2d)\(([\w ]+, [\w ]+)", _narrow, text[start:end])
    if model == text[start:end]:
        raise SystemExit(f"{WHERE}: no layer widths found to narrow; the script changed")
    t = text[:start] + model + text[end:]
    t = replace_once(t, "num_workers=20", "num_workers=0", WHERE)
    if seed is not None:
        t = insert_after(
            t,
            'def train_mnist(n_epoch: int = 100, device="cuda:0") -> None:\n',
            f"    torch.manual_seed({seed})  # gradwatch trial: --seed\n",
            WHERE,
        )
    opt = "    optim = torch.optim.Adam(ddpm.parameters(), lr=2e-4)\n"
    if broken:
        t = replace_once(t, opt, opt.replace("2e-4", "2e-2"), WHERE)
        opt = opt.replace("2e-4", "2e-2")
    t = insert_after(
        t,
        opt,
        "    import gradwatch\n"
        f"    mon = gradwatch.watch(ddpm, optim, job={job!r}, endpoint={endpoint!r})\n",
        WHERE,
    )
    t = replace_once(
        t,
        "        for x, _ in pbar:\n",
        "        for batch, (x, _) in enumerate(pbar):\n"
        f"            if batch >= {iters}:  # gradwatch trial: a bounded run\n"
        "                break\n",
        WHERE,
    )
    t = insert_after(t, "            optim.step()\n", "            mon.log(loss=loss)\n", WHERE)
    # 1,000 denoising passes at the end of each epoch: skipped (the trial scores alerts).
    t = replace_once(
        t,
        "xh = ddpm.sample(16, (1, 28, 28), device)",
        "xh = torch.zeros(16, 1, 28, 28)",
        WHERE,
    )
    t = insert_after(
        t,
        '            torch.save(ddpm.state_dict(), f"./ddpm_mnist.pth")\n',
        "    mon.close()\n",
        WHERE,
    )
    return replace_once(t, "    train_mnist()\n", '    train_mnist(1, device="cpu")\n', WHERE)


def run_variant(
    root: Path, work: Path, traces: Path, variant: str, iters: int, seed: int | None = None
) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    (vdir / "contents").mkdir(parents=True, exist_ok=True)

    def write(endpoint: str) -> list[str]:
        text = (root / WHERE).read_text(encoding="utf8")
        patched = patch(text, f"ddpm-{variant}", endpoint, iters, variant == "lr_x100", seed)
        (vdir / WHERE).write_text(patched)
        return [WHERE]

    return run_recorded(work, traces, f"ddpm-{variant}", vdir, write, {"PYTHONPATH": str(STANDINS)})


def main(argv: list[str] | None = None) -> int:
    # --seed is this trial's own; the shared trial parser reads the rest.
    seeded = argparse.ArgumentParser(add_help=False)
    seeded.add_argument("--seed", type=int, help="seed the script's draws (it seeds nothing)")
    known, rest = seeded.parse_known_args(argv)
    run = functools.partial(run_variant, seed=known.seed)
    return checkout_trial(__doc__ or "", "ddpm", WHERE, (ACCEPT, HELPFUL), ITERS, run, rest)


if __name__ == "__main__":
    sys.exit(main())
