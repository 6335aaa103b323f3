"""A trial through the Hugging Face Trainer: a small GPT-2 trained from scratch.

The model is ``GPT2LMHeadModel`` built from a config (4 layers, d 128, 4 heads, vocab 256:
bytes; no download), trained on the nanoGPT trial's local text (about 600 KB of
licences and standard-library sources, blocks of 64 bytes) by a plain ``Trainer``
with ``GradwatchCallback`` (README "Frameworks"): AdamW at the Trainer's defaults
(no weight decay, linear decay), lr 5e-4, 50 warm-up steps, batch 16, 800 steps,
CPU. Each variant runs under a real ``gradwatch collector --record`` subprocess and
its trace is replayed and scored as ``nanogpt_trial.py`` does. Needs the ``[hf]``
extra (transformers), as the dev install has.

Variants: ``healthy``; ``bf16_accum4`` (healthy: bf16 autocast, batch 4 with 4
accumulation steps, the same 16 sequences a step); ``lr_x4`` (2e-3: a high but
working rate, a healthy control: it ends with a lower eval loss than the
default); ``lr_x20`` (1e-2); ``lr_x100`` (5e-2).

    OMP_NUM_THREADS=1 python benchmarks/hf_trainer_trial.py --keep /tmp/trials/hf1
    python benchmarks/hf_trainer_trial.py --replay-only /tmp/trials/hf1
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from trials import LR_TOO_HIGH, report, run_recorded, trial_args

ITERS = 800
ACCEPT: dict[str, tuple[str, ...]] = {
    "healthy": (),
    "bf16_accum4": (),
    "lr_x4": (),
    "lr_x20": LR_TOO_HIGH,
    "lr_x100": LR_TOO_HIGH,
}
HELPFUL: dict[str, tuple[str, ...]] = {"lr_x20": ("learning rate",), "lr_x100": ("learning rate",)}
LR = 5e-4

# What every trial script starts with: the text as bytes in blocks of 64, split 90/10.
DATA = """\
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
sys.path.insert(0, {benchmarks!r})
from trials import local_text

torch.manual_seed(0)
data = torch.tensor(list(local_text(600_000).encode("ascii", "ignore")), dtype=torch.long)
BLOCK = 64
n = (len(data) - 1) // BLOCK
cut = int(n * 0.9)
GPT2 = GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=128, n_layer=4, n_head=4,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
"""

# The training script, written into the trial's work dir; {…} are filled per variant.
SCRIPT = (
    DATA
    + """\
from transformers import Trainer, TrainingArguments
from gradwatch.integrations.transformers import GradwatchCallback


class Blocks(torch.utils.data.Dataset):
    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        x = data[(self.lo + i) * BLOCK : (self.lo + i + 1) * BLOCK]
        return {{"input_ids": x, "labels": x.clone()}}


args = TrainingArguments({out!r}, max_steps={iters}, per_device_train_batch_size={batch},
                         gradient_accumulation_steps={accum}, bf16={bf16},
                         learning_rate={lr!r}, warmup_steps=50, logging_steps=50,
                         eval_strategy="steps", eval_steps=200, save_strategy="no",
                         report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
trainer = Trainer(model=GPT2LMHeadModel(GPT2), args=args, train_dataset=Blocks(0, cut),
                  eval_dataset=Blocks(cut, cut + 64),
                  callbacks=[GradwatchCallback(job={job!r}, endpoint={endpoint!r})])
trainer.train()
print("final eval_loss", trainer.evaluate()["eval_loss"])
"""
)


def rate(variant: str) -> float:
    return LR * (float(variant.split("_x")[1]) if variant.startswith("lr_x") else 1.0)


def fill(script: str, variant: str, vdir: Path, iters: int, job: str, endpoint: str) -> str:
    """``script`` with the variant's settings filled in (keys it does not use are ignored)."""
    return script.format(
        benchmarks=str(Path(__file__).resolve().parent),
        out=str(vdir / "out"),
        iters=iters,
        lr=rate(variant),
        batch=4 if variant == "bf16_accum4" else 16,
        accum=4 if variant == "bf16_accum4" else 1,
        bf16=variant == "bf16_accum4",
        job=job,
        endpoint=endpoint,
    )


def run_trial(
    doc: str,
    prefix: str,
    script: str,
    accepts: dict[str, tuple[str, ...]],
    argv: list[str] | None,
    iters: int = ITERS,
) -> int:
    """Train each chosen variant of ``script`` under a recording collector, then score."""
    _, args, variants = trial_args(doc, None, accepts, iters, argv)
    if args.replay_only is not None:
        traces = args.replay_only
    else:
        work = Path(tempfile.mkdtemp(prefix=f"{prefix}-trial-"))
        traces = args.keep or work / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        print(f"work dir {work}; gradwatch step = the trainer's global step", file=sys.stderr)
        for v in variants:
            vdir = work / v
            vdir.mkdir(parents=True, exist_ok=True)
            job = f"{prefix}-{v}"

            def write(endpoint: str, v: str = v, vdir: Path = vdir, job: str = job) -> list[str]:
                (vdir / "train.py").write_text(fill(script, v, vdir, args.iters, job, endpoint))
                return ["train.py"]

            run_recorded(work, traces, job, vdir, write, {})
    report(traces, prefix, variants, args, accepts, HELPFUL)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_trial(__doc__ or "", "hf", SCRIPT, ACCEPT, argv)


if __name__ == "__main__":
    sys.exit(main())
