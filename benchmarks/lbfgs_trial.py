"""A trial on pytorch/examples' time_sequence_prediction: LBFGS with a closure, in float64.

Every other trial steps its optimizer with no argument. Here ``optimizer.step(closure)``
runs the forward and backward passes itself, up to 20 times a step: two float64
``LSTMCell``s over 999 time steps of 97 sine waves, full batch, 15 steps. The gradients
are the closure's to compute, so the agent reads them when the closure's first call
returns (agent/closures.py). Before that change it read them before the closure ran:
each step reported the last step's gradients, and step 1 reported zeros.

The script at its own settings (lr 0.8) is the broken variant. Its loss falls to ~7e-5,
then jumps to ~1e16 at its STEP 6 (gradwatch step 7) and keeps climbing. That is
pytorch/examples issue #247, open since 2017: "After a few steps, the loss suddenly
jumps up and stays high". The fix given in that thread is a lower learning rate.
``lr_0.1`` is the healthy variant: it takes the first value from that thread that keeps
the loss down.

gradwatch's steps are the script's own (``log(step=i)``: it prints ``STEP: i`` from 0).
The script runs unmodified except for gradwatch's lines, ``weights_only=False`` in its
``torch.load`` of a numpy array (torch >= 2.6 refuses one otherwise) and no PDF plots.
It runs from a checkout that is never copied into this repository; CI never needs it.
About 6 minutes a variant on one CPU thread.

    git --git-dir=$(fetch pytorch/examples) archive HEAD time_sequence_prediction \\
        | tar -x -C /tmp/pex2
    python benchmarks/lbfgs_trial.py /tmp/pex2/time_sequence_prediction --keep /tmp/trials/lbfgs
    python benchmarks/lbfgs_trial.py --replay-only /tmp/trials/lbfgs     # current rules
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, insert_after, replace_once, run_recorded

STEPS = 15  # the script's own default
LR = {"default": "0.8", "lr_0.1": "0.1"}
ACCEPT: dict[str, tuple[str, ...] | None] = {"default": LR_TOO_HIGH, "lr_0.1": ()}
HELPFUL = {"default": ("learning rate", "lr ")}


def patch(text: str, job: str, endpoint: str, lr: str) -> str:
    """The script with gradwatch attached as docs/agent.md says for a closure."""
    w = "train.py"
    t = replace_once(
        text, "torch.load('traindata.pt')", "torch.load('traindata.pt', weights_only=False)", w
    )
    opt = "    optimizer = optim.LBFGS(seq.parameters(), lr=0.8)\n"
    t = replace_once(t, opt, opt.replace("0.8", lr), w)
    watch = f"    mon = gradwatch.watch(seq, optimizer, job={job!r}, endpoint={endpoint!r})\n"
    t = insert_after(t, opt.replace("0.8", lr), "    import gradwatch\n" + watch, w)
    t = replace_once(
        t,
        "        optimizer.step(closure)\n",
        "        loss = optimizer.step(closure)\n        mon.log(loss=loss, step=i)\n",
        w,
    )
    t = insert_after(
        t,
        "            print('test loss:', loss.item())\n",
        "            mon.log_eval(loss=loss)\n",
        w,
    )
    t = replace_once(t, "        plt.savefig('predict%d.pdf'%i)\n", "", w)
    return t + "    mon.close()\n"


def run_variant(root: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    vdir.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "generate_sine_wave.py"):
        shutil.copy(root / name, vdir / name)
    subprocess.run([sys.executable, "generate_sine_wave.py"], cwd=vdir, check=True)
    job = f"lbfgs-{variant}"

    def write(endpoint: str) -> list[str]:
        text = (root / "train.py").read_text(encoding="utf8")
        (vdir / "train.py").write_text(patch(text, job, endpoint, LR[variant]))
        return ["train.py", "--steps", str(iters)]

    return run_recorded(work, traces, job, vdir, write, {})


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "lbfgs", "generate_sine_wave.py", (ACCEPT, HELPFUL), STEPS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
