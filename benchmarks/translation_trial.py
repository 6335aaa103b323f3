"""A trial on pytorch/examples' ``language_translation``: an encoder-decoder Transformer.

No other trial trains a sequence-to-sequence model: ``nn.Transformer`` with an encoder
and a decoder (cross-attention from the target to the source), post-LayerNorm blocks
with functional ReLUs, padding masks and a causal mask, two embeddings (source and
target), cross-entropy that ignores padding, and Adam at the paper's betas (0.9, 0.98)
at lr 1e-4 with no warm-up. Its evaluation runs in ``eval()`` *with* autograd on (the
script never calls ``torch.no_grad``), and it saves the model each epoch. Run as a user
would, unmodified but for gradwatch and for what this CPU needs:

* a smaller model through the script's own flags: ``--embed_size 128 --enc_layers 3
  --dec_layers 3 --dim_feedforward 256 --attn_heads 4 --batch 64`` (its defaults, 512
  wide and 5 + 5 layers at batch 128, take seconds a step here);
* Multi30k and spaCy cannot be had, so ``benchmarks/standins/torchtext`` answers the
  imports with a synthetic German-like to English-like corpus (8,000 training pairs, a
  verb that moves; **not Multi30k**): 125 steps an epoch;
* ``--iters`` epochs (default 6, 750 steps), not the script's 30.

gradwatch is attached as README's quickstart says: ``watch(model, optim)`` once the
optimizer exists, ``log(loss=loss)`` after ``optim.step()``, ``log_eval`` after each
validation, ``close()`` at the end. Variants: ``healthy``, and ``lr_x100`` (``--lr
1e-2``).

    mkdir /tmp/pex3 && git --git-dir=$(fetch pytorch/examples) archive HEAD \\
        language_translation | tar -x -C /tmp/pex3
    python benchmarks/translation_trial.py /tmp/pex3/language_translation --keep /tmp/trials/mt
    python benchmarks/translation_trial.py --replay-only /tmp/trials/mt   # current rules
"""

from __future__ import annotations

import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, insert_after, replace_once, run_patched

ITERS = 6  # epochs of 125 steps
MAIN = "main.py"
ACCEPT: dict[str, tuple[str, ...] | None] = {"healthy": (), "lr_x100": LR_TOO_HIGH}
HELPFUL: dict[str, tuple[str, ...]] = {"lr_x100": ("learning rate", "lr ")}
LEARNING_RATES = {"lr_x100": "1e-2"}
SMALLER = ["--embed_size", "128", "--enc_layers", "3", "--dec_layers", "3"]
SMALLER += ["--dim_feedforward", "256", "--attn_heads", "4", "--batch", "64"]


def patch(text: str, job: str, endpoint: str) -> str:
    """``main.py`` with gradwatch attached as README's quickstart says."""
    opt = (
        "    optim = torch.optim.Adam(model.parameters(), lr=opts.lr, betas=(0.9, 0.98), "
        "eps=1e-9)\n"
    )
    t = insert_after(
        text,
        opt,
        "    global MON\n    import gradwatch\n"
        f"    MON = gradwatch.watch(model, optim, job={job!r}, endpoint={endpoint!r})\n",
        MAIN,
    )
    t = insert_after(t, "        optim.step()\n", "        MON.log(loss=loss)\n", MAIN)
    val = "        val_loss   = validate(model, valid_dl, loss_fn, special_symbols)\n"
    t = insert_after(t, val, "        MON.log_eval(loss=val_loss)\n", MAIN)
    return replace_once(
        t, "        main(args)\n", "        main(args)\n        MON.close()\n", MAIN
    )


def run_variant(root: Path, work: Path, traces: Path, variant: str, iters: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    job = f"mt-{variant}"
    args = ["--epochs", str(iters), "--logging_dir", "./out/", *SMALLER]
    if variant in LEARNING_RATES:
        args += ["--lr", LEARNING_RATES[variant]]
    return run_patched(
        root, work, traces, job, variant, lambda text, at: patch(text, job, at), args, main=MAIN
    )


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "mt", "src/model.py", (ACCEPT, HELPFUL), ITERS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
