"""A trial on kuangliu/pytorch-cifar's ``main.py``: ResNet-18 on CIFAR-10, the most copied recipe.

What the other trials lack is the standard image-classification run: a ResNet with
BatchNorm in every block, SGD at lr 0.1 with momentum 0.9 and weight decay 5e-4, a cosine
schedule, random crops and flips, a ``DataLoader`` with two worker processes, and a test
pass (in ``eval()``) after every epoch. Run as a user would, unmodified but for gradwatch
and for what this CPU needs:

* the model is ``ResNet18()`` (the script's own commented line; its default, SimpleDLA,
  is 1.5x slower here): 11.2M parameters, ~2.8 s a step at the script's batch of 128 on
  two threads (the other trials run on one);
* CIFAR-10 cannot be downloaded, so ``benchmarks/standins/torchvision`` answers it: 6,400
  training and 1,000 test images of 32x32, each a warped digit (its class) in one random
  colour on another (**not CIFAR-10**), so an epoch is 50 steps;
* ``--iters`` epochs (default 3, 150 steps), not the script's 200;
* its ``utils.py`` reads the terminal's width from ``stty size``, which fails without a
  terminal: a stand-in ``stty`` on the script's ``PATH`` answers "24 80".

gradwatch is attached as README's quickstart says: ``watch(net, optimizer)`` once the
optimizer exists, ``log(loss=loss)`` after ``optimizer.step()``, ``log_eval`` at the end
of ``test()`` while the model is still in ``eval()``, ``close()`` after the last epoch.
Variants: ``healthy``, and ``lr_x10`` (``--lr 1.0``).

    mkdir /tmp/cifar && git --git-dir=$(fetch kuangliu/pytorch-cifar) archive HEAD \\
        | tar -x -C /tmp/cifar
    python benchmarks/cifar_trial.py /tmp/cifar --keep /tmp/trials/cifar
    python benchmarks/cifar_trial.py --replay-only /tmp/trials/cifar   # current rules
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, insert_after, replace_once, run_patched

ITERS = 3  # epochs of 50 steps
MAIN = "main.py"
ACCEPT: dict[str, tuple[str, ...] | None] = {"healthy": (), "lr_x10": LR_TOO_HIGH}
HELPFUL: dict[str, tuple[str, ...]] = {"lr_x10": ("learning rate", "lr ")}
LEARNING_RATES = {"lr_x10": "1.0"}


def patch(text: str, job: str, endpoint: str, epochs: int) -> str:
    """``main.py`` with gradwatch attached as README's quickstart says, ResNet-18, and
    ``epochs`` epochs."""
    t = replace_once(text, "net = SimpleDLA()\n", "net = ResNet18()\n", MAIN)
    t = insert_after(
        t,
        "scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)\n",
        "import gradwatch\n"
        f"mon = gradwatch.watch(net, optimizer, job={job!r}, endpoint={endpoint!r})\n",
        MAIN,
    )
    t = insert_after(t, "        optimizer.step()\n", "        mon.log(loss=loss)\n", MAIN)
    t = insert_after(
        t,
        "    acc = 100.*correct/total\n",
        "    mon.log_eval(loss=test_loss / (batch_idx + 1))\n",
        MAIN,
    )
    t = replace_once(
        t,
        "for epoch in range(start_epoch, start_epoch+200):\n",
        f"for epoch in range(start_epoch, start_epoch+{epochs}):\n",
        MAIN,
    )
    return t + "mon.close()\n"


def _stty(vdir: Path) -> None:
    """utils.py runs `stty size`, which prints nothing without a terminal: answer "24 80"."""
    bin_dir = vdir / "bin"
    bin_dir.mkdir()
    stty = bin_dir / "stty"
    stty.write_text("#!/bin/sh\necho 24 80\n")
    stty.chmod(stty.stat().st_mode | stat.S_IXUSR)


def run_variant(root: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    job = f"cifar-{variant}"
    args = ["--lr", LEARNING_RATES[variant]] if variant in LEARNING_RATES else []
    path = f"{work / variant / 'bin'}{os.pathsep}{os.environ['PATH']}"
    return run_patched(
        root,
        work,
        traces,
        job,
        variant,
        lambda text, at: patch(text, job, at, iters),
        args,
        main=MAIN,
        skip=("checkpoint", "data"),
        prepare=_stty,
        env={"PATH": path},
        threads=2,
    )


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(__doc__ or "", "cifar", MAIN, (ACCEPT, HELPFUL), ITERS, run_variant, argv)


if __name__ == "__main__":
    sys.exit(main())
