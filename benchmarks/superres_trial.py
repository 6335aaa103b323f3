"""A trial on pytorch/examples' ``super_resolution``: a sub-pixel CNN regressing pixels.

No other trial regresses images: ESPCN (Shi et al. 2016), four convolutions with
orthogonal init and a ``PixelShuffle`` that turns 9 channels into a 3x larger image,
MSE on pixel values in [0, 1] (losses ~1e-3), Adam at the script's default lr 0.01
with no warm-up, a PSNR test after each epoch and the whole model saved each epoch
(``torch.save(model)``). Run as a user would, unmodified but for gradwatch and for what
this machine needs:

* BSDS300 cannot be downloaded, so ``benchmarks/standins/bsds.py`` writes 200 + 100
  synthetic scenes where the script looks (**not BSDS300**), and the torchvision
  stand-in takes the PIL images the script's dataset yields; ``six`` (for its unused
  download) is answered by ``benchmarks/standins/six``;
* ``--threads 1`` (the data loader's workers; 4 by default) on this 2-core machine;
* ``--iters`` epochs (default 20; the script's default is 2) of 4 steps each at its
  default batch of 64: 80 steps.

gradwatch is attached as README's quickstart says: ``watch(model, optimizer)`` once the
optimizer exists, ``log(loss=loss)`` after ``optimizer.step()``, ``close()`` at the end
(its test reports PSNR, no loss: nothing for ``log_eval``). Variants:

* ``default``: the script's lr, 0.01. On these images it is too high, which the script's
  own PSNR shows, not gradwatch: the loss jumps x50 at step 2, the last hidden ReLU
  (``self.relu``, reused; its last call is measured) goes from 48% to 97% zeros and stays
  near 87% for the run, and the test PSNR after 20 epochs is 24.7 dB against 29.1 dB at
  lr 0.001 (2026-12-07). Scored as an lr fault: a page here is the right one. The label
  was set from that PSNR after the first run, which paged; on the real BSDS300 it was not
  measured;
* ``lr_x0.1`` (``--lr 0.001``): healthy, no spike, zeros 48-71%, PSNR 29.1 dB;
* ``lr_x100`` (``--lr 1.0``): broken (PSNR -14 dB).

    mkdir /tmp/pex4 && git --git-dir=$(fetch pytorch/examples) archive HEAD \\
        super_resolution | tar -x -C /tmp/pex4
    python benchmarks/superres_trial.py /tmp/pex4/super_resolution --keep /tmp/trials/sr
    python benchmarks/superres_trial.py --replay-only /tmp/trials/sr   # current rules
"""

from __future__ import annotations

import sys
from pathlib import Path

from standins.bsds import write_bsds
from trials import LR_TOO_HIGH, checkout_trial, insert_after, replace_once, run_patched

ITERS = 20  # epochs of 4 steps
MAIN = "main.py"
ACCEPT: dict[str, tuple[str, ...] | None] = {
    "default": LR_TOO_HIGH,
    "lr_x0.1": (),
    "lr_x100": LR_TOO_HIGH,
}
HELPFUL = {v: ("learning rate", "lr ") for v, accept in ACCEPT.items() if accept}
LEARNING_RATES = {"lr_x0.1": "0.001", "lr_x100": "1.0"}


def patch(text: str, job: str, endpoint: str) -> str:
    """``main.py`` with gradwatch attached as README's quickstart says."""
    opt = "optimizer = optim.Adam(model.parameters(), lr=opt.lr)\n"
    t = insert_after(
        text,
        opt,
        f"import gradwatch\nmon = gradwatch.watch(model, optimizer, job={job!r}, "
        f"endpoint={endpoint!r})\n",
        MAIN,
    )
    t = insert_after(t, "        optimizer.step()\n", "        mon.log(loss=loss)\n", MAIN)
    return replace_once(t, "    checkpoint(epoch)\n", "    checkpoint(epoch)\nmon.close()\n", MAIN)


def run_variant(root: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    job = f"superres-{variant}"
    args = ["--upscale_factor", "3", "--nEpochs", str(iters), "--threads", "1"]
    if variant in LEARNING_RATES:
        args += ["--lr", LEARNING_RATES[variant]]
    return run_patched(
        root,
        work,
        traces,
        job,
        variant,
        lambda text, at: patch(text, job, at),
        args,
        main=MAIN,
        skip=("dataset",),
        prepare=write_bsds,
    )


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "superres", "model.py", (ACCEPT, HELPFUL), ITERS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
