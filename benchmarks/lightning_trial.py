"""The HF Trainer trial's GPT-2, trained by Lightning with gradwatch's Lightning callback.

The same model and text as ``hf_trainer_trial.py`` (whose runner this uses), inside a
``LightningModule``: AdamW with weight decay 0.1, a one-cycle schedule stepped every
batch, gradient clipping at 1.0 by the Trainer, validation every 200 steps, 800 steps,
CPU; ``GradwatchCallback`` from ``gradwatch.integrations.lightning`` (README
"Frameworks"). Needs the ``[lightning]`` and ``[hf]`` extras, as the dev install has.
The rules were not designed on these runs: a held-out check of the HF trial's findings.

Variants: ``healthy`` (lr 5e-4); ``lr_x100`` (5e-2).

    OMP_NUM_THREADS=1 python benchmarks/lightning_trial.py --keep /tmp/trials/lt1
    python benchmarks/lightning_trial.py --replay-only /tmp/trials/lt1
"""

from __future__ import annotations

import sys

from hf_trainer_trial import DATA, run_trial
from trials import LR_TOO_HIGH

ACCEPT: dict[str, tuple[str, ...]] = {"healthy": (), "lr_x100": LR_TOO_HIGH}

# The training script, written into the trial's work dir; {…} are filled per variant.
SCRIPT = (
    DATA
    + """\
import lightning as L
from gradwatch.integrations.lightning import GradwatchCallback

blocks = data[: n * BLOCK].view(n, BLOCK)


class GPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.m = GPT2LMHeadModel(GPT2)

    def training_step(self, batch, i):
        loss = self.m(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        self.log("val_loss", self.m(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr={lr!r}, weight_decay=0.1)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr={lr!r}, total_steps={iters})
        return [opt], [{{"scheduler": cycle, "interval": "step"}}]


trainer = L.Trainer(max_steps={iters}, accelerator="cpu", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, val_check_interval=200, gradient_clip_val=1.0,
                    callbacks=[GradwatchCallback(job={job!r}, endpoint={endpoint!r})])
trainer.fit(GPT(), torch.utils.data.DataLoader(blocks[:cut], batch_size=16, shuffle=True),
            torch.utils.data.DataLoader(blocks[cut : cut + 64], batch_size=16))
print("final val_loss", float(trainer.callback_metrics["val_loss"]))
"""
)


def main(argv: list[str] | None = None) -> int:
    return run_trial(__doc__ or "", "lt", SCRIPT, ACCEPT, argv)


if __name__ == "__main__":
    sys.exit(main())
