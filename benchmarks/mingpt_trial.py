"""A second trial on code nobody here wrote: karpathy/minGPT's adder project.

minGPT makes its optimizer inside ``Trainer.run()`` and offers callbacks, so a
user attaches gradwatch differently from nanoGPT: ``watch(model)`` before
``run()`` (no optimizer to pass: the gradients are read in ``mon.log``, which
runs in the ``on_batch_end`` callback, after the update and before the next
``zero_grad``), ``mon.log(loss=trainer.loss, lr=..., step=trainer.iter_num)``
in the callback, ``mon.close()`` after ``run()``. This script makes those
edits to a copy of ``projects/adder/adder.py`` by text patching (never copied
into this repository; CI never needs it), runs each variant for 2,000
iterations (gpt-nano, 2-digit addition, minGPT's defaults: AdamW lr 5e-4,
weight decay 0.1, clip 1.0, batch 64) against a real ``gradwatch collector
--record`` subprocess, replays the trace with the current rules and scores it
as ``nanogpt_trial.py`` does.

Variants: ``healthy``; ``lr_x100`` (learning rate 5e-2); ``zero_grad_late``
(``model.zero_grad(set_to_none=True)`` moved from before ``backward()`` to
after it in a copy of ``mingpt/trainer.py``: every update gets no gradient).

    OMP_NUM_THREADS=1 python benchmarks/mingpt_trial.py /tmp/mingpt --keep /tmp/trials/mg1
    python benchmarks/mingpt_trial.py --replay-only /tmp/trials/mg1   # current rules, old traces
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, replace_once, run_recorded

ITERS = 2000
ACCEPT: dict[str, tuple[str, ...]] = {
    "healthy": (),
    "lr_x100": LR_TOO_HIGH,
    "zero_grad_late": ("dead_pipeline", "update_ratio"),
}
HELPFUL: dict[str, tuple[str, ...]] = {
    "lr_x100": ("learning rate", "lr "),
    "zero_grad_late": ("zero_grad", "optimizer", "loss wiring", "requires_grad"),
}


def patch_adder(text: str, job: str, endpoint: str) -> str:
    """adder.py with gradwatch attached the way minGPT's callbacks allow."""
    t = replace_once(
        text,
        "    trainer = Trainer(config.trainer, model, train_dataset)\n",
        "    trainer = Trainer(config.trainer, model, train_dataset)\n"
        "    import gradwatch\n"
        f"    mon = gradwatch.watch(model, job={job!r}, endpoint={endpoint!r})\n",
        "adder.py",
    )
    t = replace_once(
        t,
        "        global top_score\n",
        "        global top_score\n"
        "        mon.log(loss=trainer.loss, lr=trainer.optimizer.param_groups[0]['lr'], "
        "step=trainer.iter_num)\n",
        "adder.py",
    )
    return replace_once(
        t, "    trainer.run()\n", "    trainer.run()\n    mon.close()\n", "adder.py"
    )


def patch_trainer(text: str, variant: str) -> str:
    if variant != "zero_grad_late":
        return text
    return replace_once(
        text,
        "            model.zero_grad(set_to_none=True)\n            self.loss.backward()\n",
        "            self.loss.backward()\n"
        "            model.zero_grad(set_to_none=True)  # the bug\n",
        "mingpt/trainer.py",
    )


def variant_args(variant: str) -> list[str]:
    return ["--trainer.learning_rate=5e-2"] if variant == "lr_x100" else []


def run_variant(mingpt: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    shutil.copytree(mingpt / "mingpt", vdir / "mingpt", dirs_exist_ok=True)
    trainer = vdir / "mingpt" / "trainer.py"
    trainer.write_text(patch_trainer(trainer.read_text(), variant))

    def write(endpoint: str) -> list[str]:
        adder = (mingpt / "projects" / "adder" / "adder.py").read_text()
        (vdir / "adder.py").write_text(patch_adder(adder, f"mingpt-{variant}", endpoint))
        return [
            "adder.py",
            f"--trainer.max_iters={iters}",
            "--trainer.num_workers=0",
            f"--system.work_dir='{vdir / 'out'}'",
            *variant_args(variant),
        ]

    return run_recorded(work, traces, f"mingpt-{variant}", vdir, write, {"PYTHONPATH": str(vdir)})


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "",
        "mingpt",
        "projects/adder/adder.py",
        (ACCEPT, HELPFUL),
        ITERS,
        run_variant,
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
