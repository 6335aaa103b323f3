"""A trial on a LLaMA-style model nobody here wrote: karpathy/llama2.c's ``train.py``.

The architecture the other trials lack: RMSNorm, SwiGLU feed-forwards (SiLU), rotary
embeddings, tied input/output embeddings, and llama2.c's own loop (AdamW, betas 0.9/0.95,
weight decay 0.1 on matrices only, linear warm-up then cosine decay, clipping at 1.0,
gradient accumulation, ``optimizer.zero_grad`` right after the step). gradwatch is
attached the way README's quickstart says, by text patching a copy of ``train.py``
(never copied into this repository; CI never needs it):

* ``watch(model, optimizer, start_step=iter_num)`` after the optimizer is made;
* the step's mean loss summed over the micro-batches (``loss`` is already divided by
  the accumulation steps) and what ``clip_grad_norm_`` returns (the pre-clip norm),
  ``mon.log(loss=..., grad_norm=..., step=iter_num)`` after ``scaler.update()`` and
  before ``zero_grad``;
* ``mon.log_eval(loss=val)`` after each evaluation, ``mon.close()`` at the end.

TinyStories needs a download, so the data module is replaced by one over local ASCII
text (``nanogpt_trial.local_text``, the bytes as tokens: ``vocab_source=custom``,
``vocab_size=128``). A small model for this CPU: dim 128, 4 layers, 4 heads,
batch 16 x 2 micro-batches of 64 tokens, 1,500 iterations, warm-up 100, llama2.c's default lr 5e-4.

Variants: ``healthy``; ``healthy_gate_stats`` (with
``activation_modules={'*.feed_forward.w1': 'pre:silu'}``: the gates' SiLUs measured);
``lr_x100`` (5e-2); ``no_zero_grad`` (the
``optimizer.zero_grad`` line removed: every step's gradient adds to all earlier ones).
None of them took part in designing a rule.

    OMP_NUM_THREADS=1 python benchmarks/llama2c_trial.py /tmp/llama2c --keep /tmp/trials/ll1
    python benchmarks/llama2c_trial.py --replay-only /tmp/trials/ll1   # current rules
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, local_text, replace_once, run_recorded

ITERS = 1500
ACCEPT: dict[str, tuple[str, ...]] = {
    "healthy": (),
    "healthy_gate_stats": (),
    "lr_x100": LR_TOO_HIGH,
    # Stale gradients summed step after step: a gradient norm that climbs, updates that
    # follow the sum, not this step's batch.
    "no_zero_grad": ("exploding_gradients", "dead_pipeline", "update_ratio", "weight_runaway"),
}
HELPFUL: dict[str, tuple[str, ...]] = {
    "lr_x100": ("learning rate", "lr "),
    "no_zero_grad": ("zero_grad",),
}
SMALL = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--vocab_source=custom",
    "--vocab_size=128",
    "--dim=128",
    "--n_layers=4",
    "--n_heads=4",
    "--n_kv_heads=4",
    "--max_seq_len=64",
    "--batch_size=16",
    "--gradient_accumulation_steps=2",
    "--warmup_iters=100",
    "--eval_interval=500",
    "--eval_iters=10",
]

# Stands in for llama2.c's tinystories.py: random windows of local ASCII text, the bytes
# as tokens; the same validation windows at every evaluation.
DATA_MODULE = """\
import numpy as np
import torch

DATA = np.fromfile("data.bin", dtype=np.uint8)


class Task:
    @staticmethod
    def iter_batches(batch_size, device, num_workers=0, split="train", max_seq_len=128, **_):
        cut = int(len(DATA) * 0.9)
        data = DATA[:cut] if split == "train" else DATA[cut:]
        rng = np.random.default_rng(1337 if split == "train" else 42)
        while True:
            ix = rng.integers(0, len(data) - max_seq_len - 1, batch_size)
            rows = np.stack([data[i : i + max_seq_len + 1] for i in ix]).astype(np.int64)
            batch = torch.from_numpy(rows)
            yield batch[:, :-1].contiguous().to(device), batch[:, 1:].contiguous().to(device)
"""


def patch_train(text: str, job: str, endpoint: str, variant: str) -> str:
    """train.py with gradwatch attached as README's quickstart says."""
    # The SwiGLU gate's SiLU is a function call: name the layer whose output it takes.
    acts = (
        ", activation_modules={'*.feed_forward.w1': 'pre:silu'}"
        if variant == "healthy_gate_stats"
        else ""
    )
    t = replace_once(
        text,
        "checkpoint = None  # free up memory\n",
        "checkpoint = None  # free up memory\n"
        "import gradwatch\n"
        f"mon = gradwatch.watch(model, optimizer, job={job!r}, endpoint={endpoint!r}, "
        f"start_step=iter_num{acts})\n",
        "train.py",
    )
    t = replace_once(
        t,
        "    for micro_step in range(gradient_accumulation_steps):\n",
        "    gw_loss = 0.0\n    for micro_step in range(gradient_accumulation_steps):\n",
        "train.py",
    )
    t = replace_once(
        t,
        "            loss = loss / gradient_accumulation_steps\n",
        "            loss = loss / gradient_accumulation_steps\n"
        "            gw_loss = gw_loss + loss.detach()\n",
        "train.py",
    )
    t = replace_once(
        t,
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
        "        gw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
        "train.py",
    )
    t = replace_once(
        t,
        "    scaler.update()\n",
        "    scaler.update()\n    mon.log(loss=gw_loss, grad_norm=gw_norm, step=iter_num)\n",
        "train.py",
    )
    t = replace_once(
        t,
        "        if wandb_log:\n            try:\n",
        "        mon.log_eval(loss=float(losses['val']))\n"
        "        if wandb_log:\n            try:\n",
        "train.py",
    )
    if variant == "no_zero_grad":
        t = replace_once(
            t,
            "    optimizer.zero_grad(set_to_none=True)\n",
            "    pass  # the bug: no optimizer.zero_grad()\n",
            "train.py",
        )
    return t + "\nmon.close()\n"


def run_variant(llama: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    vdir.mkdir(parents=True, exist_ok=True)
    for name in ("model.py", "configurator.py", "export.py"):
        shutil.copy(llama / name, vdir / name)
    (vdir / "tinystories.py").write_text(DATA_MODULE)
    (vdir / "data.bin").write_bytes(local_text().encode("ascii"))

    def write(endpoint: str) -> list[str]:
        train = (llama / "train.py").read_text()
        (vdir / "train.py").write_text(patch_train(train, f"llama2c-{variant}", endpoint, variant))
        lr = ["--learning_rate=5e-2"] if variant == "lr_x100" else []
        return ["train.py", *SMALL, f"--max_iters={iters}", f"--out_dir={vdir / 'out'}", *lr]

    return run_recorded(work, traces, f"llama2c-{variant}", vdir, write, {})


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "llama2c", "train.py", (ACCEPT, HELPFUL), ITERS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
