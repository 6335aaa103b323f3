"""A trial on pytorch/examples' DDP tutorial: two ranks under torchrun, on the CPU.

``distributed/ddp-tutorial-series/multigpu_torchrun.py`` trains ``nn.Linear(20, 1)``
with SGD (lr 1e-3) on 2,048 random examples split by a ``DistributedSampler``,
snapshots ``model.module.state_dict()`` every ``save_every`` epochs from rank 0, and
takes ``F.cross_entropy(output, targets)`` of a one-column output against float
targets in [0, 1): class *probabilities* over one class, so the loss is exactly 0 and so
is every gradient. The tutorial as written trains nothing, and prints nothing that would
say so (it prints no loss). gradwatch is attached as README's quickstart says for DDP:
``watch(ddp.module, optimizer)`` on every rank, ``log(loss=loss)`` after
``optimizer.step()``, ``close()`` at the end; this machine has no GPU, so ``nccl`` and
the device moves become ``gloo`` on the CPU (the only other changes).

Variants (none took part in designing a rule):

* ``as_written``: the tutorial's loss. Broken: a dead pipeline;
* ``mse``: ``F.mse_loss`` instead, what a reader fixing it would write. Healthy: it
  learns the targets' mean (a random target has nothing more to learn);
* ``mse_lr_x1000``: the same at lr 1.0, past the stability limit of this least-squares
  problem (2 / the largest eigenvalue of E[x x^T], ~0.37): it diverges.

    git --git-dir=$(fetch pytorch/examples) archive HEAD distributed/ddp-tutorial-series \\
        | tar -x -C /tmp/pex2
    python benchmarks/ddp_trial.py /tmp/pex2/distributed/ddp-tutorial-series --keep /tmp/trials/ddp1
    python benchmarks/ddp_trial.py --replay-only /tmp/trials/ddp1     # current rules
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, replace_once, run_recorded

EPOCHS = 40  # 32 steps an epoch on each of the 2 ranks
ACCEPT: dict[str, tuple[str, ...] | None] = {
    "as_written": ("dead_pipeline",),
    "mse": (),
    "mse_lr_x1000": LR_TOO_HIGH,
}
HELPFUL = {
    "as_written": ("loss depend", "zero_grad", "detached"),
    "mse_lr_x1000": ("learning rate", "lr "),
}
SCRIPT = "multigpu_torchrun.py"


def patch(text: str, variant: str, job: str, endpoint: str) -> str:
    """The tutorial on the CPU with gradwatch attached as README's quickstart says for DDP."""

    def sub(t: str, old: str, new: str) -> str:
        return replace_once(t, old, new, SCRIPT)

    t = sub(
        text,
        '    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n'
        '    init_process_group(backend="nccl")\n',
        '    init_process_group(backend="gloo")  # gradwatch trial: no GPU here\n',
    )
    t = sub(t, "        self.model = model.to(self.gpu_id)\n", "        self.model = model\n")
    t = sub(t, "            source = source.to(self.gpu_id)\n", "")
    t = sub(t, "            targets = targets.to(self.gpu_id)\n", "")
    t = sub(
        t,
        "        self.model = DDP(self.model, device_ids=[self.gpu_id])\n",
        "        self.model = DDP(self.model)\n"
        "        import gradwatch\n"
        f"        self.mon = gradwatch.watch(self.model.module, self.optimizer, job={job!r}, "
        f"endpoint={endpoint!r})\n",
    )
    t = sub(
        t,
        "        self.optimizer.step()\n",
        "        self.optimizer.step()\n        self.mon.log(loss=loss)\n",
    )
    t = sub(
        t,
        "        for epoch in range(self.epochs_run, max_epochs):\n",
        "        self.mon_epochs(max_epochs)\n        self.mon.close()\n\n"
        "    def mon_epochs(self, max_epochs: int):\n"
        "        for epoch in range(self.epochs_run, max_epochs):\n",
    )
    if variant.startswith("mse"):
        t = sub(t, "F.cross_entropy(output, targets)", "F.mse_loss(output, targets)")
    if variant == "mse_lr_x1000":
        t = sub(t, "lr=1e-3)", "lr=1.0)")
    return t


def run_variant(root: Path, work: Path, traces: Path, variant: str, epochs: int) -> Path:
    """Train one variant on two ranks under a fresh recording collector; return its trace."""
    vdir = work / variant
    vdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / "datautils.py", vdir / "datautils.py")

    def write(endpoint: str) -> list[str]:
        text = (root / SCRIPT).read_text(encoding="utf8")
        (vdir / SCRIPT).write_text(patch(text, variant, f"ddp-{variant}", endpoint))
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        return [*torchrun, SCRIPT, str(epochs), "10"]

    return run_recorded(work, traces, f"ddp-{variant}", vdir, write, {})


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "ddp", SCRIPT, (ACCEPT, HELPFUL), EPOCHS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
