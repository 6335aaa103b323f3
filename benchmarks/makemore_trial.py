"""A trial on karpathy/makemore: six small character-level architectures, one loop.

makemore.py trains on its own ``names.txt`` (32k names, in the repository) with AdamW
(lr 5e-4, weight decay 0.01, betas 0.9/0.99), a DataLoader with 4 worker processes, an
evaluation every 500 steps and ``model.state_dict()`` saved when the test loss improves.
What the other trials lack is its ``--type``: a bigram table (one ``nn.Parameter``, no
layer at all), an MLP over concatenated embeddings (tanh), a vanilla RNN cell (tanh), a
GRU cell, a bag-of-words causal average, and a small transformer (GELU written by hand).
gradwatch is attached the way README's quickstart says, by text patching a copy of
``makemore.py`` (never copied into this repository; CI never needs it):

* ``watch(model, optimizer, start_step=0)`` once the optimizer is made (before the
  DataLoader forks its workers);
* ``mon.log(loss=loss, step=step)`` after ``optimizer.step()`` (gradwatch's steps are
  the script's, from 0);
* ``mon.log_eval(loss=test_loss)`` after each evaluation; ``mon.close()`` at the end.

TensorBoard is not installed here, so its ``SummaryWriter`` is replaced by a stand-in
that drops the scalars. 1,500 steps per variant (evaluations at 500 and 1,000).

Variants: ``healthy_<type>`` for each of the six types at the script's defaults, and
``lr_x100`` (the transformer at 5e-2). None of them took part in designing a rule.

    git --git-dir=$(fetch karpathy/makemore) archive HEAD | tar -x -C /tmp/makemore
    python benchmarks/makemore_trial.py /tmp/makemore --keep /tmp/trials/mm1
    python benchmarks/makemore_trial.py --replay-only /tmp/trials/mm1   # current rules
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, replace_once, run_recorded

ITERS = 1500
TYPES = ("transformer", "bigram", "mlp", "rnn", "gru", "bow")
ACCEPT: dict[str, tuple[str, ...]] = {f"healthy_{t}": () for t in TYPES} | {"lr_x100": LR_TOO_HIGH}
HELPFUL: dict[str, tuple[str, ...]] = {"lr_x100": ("learning rate", "lr ")}

NO_TENSORBOARD = """\
class SummaryWriter:  # gradwatch trial: TensorBoard is not installed; scalars are dropped
    def __init__(self, *args, **kwargs):
        pass

    def add_scalar(self, *args, **kwargs):
        pass

    def flush(self):
        pass
"""


def patch_makemore(text: str, job: str, endpoint: str) -> str:
    """makemore.py with gradwatch attached as README's quickstart says."""
    t = replace_once(
        text, "from torch.utils.tensorboard import SummaryWriter\n", NO_TENSORBOARD, "makemore.py"
    )
    t = replace_once(
        t,
        "betas=(0.9, 0.99), eps=1e-8)\n",
        "betas=(0.9, 0.99), eps=1e-8)\n"
        "    import gradwatch\n"
        f"    mon = gradwatch.watch(model, optimizer, job={job!r}, endpoint={endpoint!r}, "
        "start_step=0)\n",
        "makemore.py",
    )
    t = replace_once(
        t,
        "        optimizer.step()\n",
        "        optimizer.step()\n        mon.log(loss=loss, step=step)\n",
        "makemore.py",
    )
    t = replace_once(
        t,
        '            writer.add_scalar("Loss/train", train_loss, step)\n',
        "            mon.log_eval(loss=test_loss)\n"
        '            writer.add_scalar("Loss/train", train_loss, step)\n',
        "makemore.py",
    )
    return replace_once(
        t,
        "        if args.max_steps >= 0 and step >= args.max_steps:\n            break\n",
        "        if args.max_steps >= 0 and step >= args.max_steps:\n            break\n"
        "    mon.close()\n",
        "makemore.py",
    )


def run_variant(root: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    vdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "names.txt", vdir / "names.txt")
    kind = "transformer" if variant == "lr_x100" else variant.removeprefix("healthy_")

    def write(endpoint: str) -> list[str]:
        text = (root / "makemore.py").read_text(encoding="utf8")
        (vdir / "makemore.py").write_text(patch_makemore(text, f"makemore-{variant}", endpoint))
        lr = ["--learning-rate", "5e-2"] if variant == "lr_x100" else []
        return ["makemore.py", "--type", kind, "--max-steps", str(iters), "-o", "out", *lr]

    return run_recorded(work, traces, f"makemore-{variant}", vdir, write, {})


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "makemore", "makemore.py", (ACCEPT, HELPFUL), ITERS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
