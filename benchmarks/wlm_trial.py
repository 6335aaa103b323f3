"""A trial on pytorch/examples' word_language_model: an LSTM trained with no optimizer.

The loop the other trials lack: the update written by hand
(``p.data.add_(p.grad, alpha=-lr)``) at a learning rate of 20, gradients clipped to a
total norm of 0.25, the rate divided by 4 by hand whenever the validation loss does not
improve, an LSTM (its gates' sigmoids and tanhs inside one kernel: no activation
module), ``log_softmax`` then ``NLLLoss``, and the whole model saved with
``torch.save(model)`` after every improving epoch and reloaded at the end with
``torch.load``'s default ``weights_only``. gradwatch is attached the way README's
quickstart says, by text patching a copy of ``main.py`` (never copied into this
repository; CI never needs it):

* ``watch(model, optimizer or None)`` once the model (and, with ``--use-optimizer``,
  its AdamW) is made;
* ``mon.log(loss=loss, grad_norm=<what clip_grad_norm_ returns>, lr=lr)`` after the
  update and before the next ``zero_grad`` (``lr=`` only for the hand-written update);
* ``mon.log_eval(loss=val_loss)`` after each epoch's evaluation; ``mon.close()`` at
  the very end, after the script reloaded its best model while still watched.

Data: the checkout's own WikiText-2 files. The mirror holds ``valid.txt`` and
``test.txt`` but not the 10 MB ``train.txt``, and a CPU epoch of it would take an
hour, so the trial trains on ``test.txt`` (~245k tokens, ~350 steps an epoch) and
splits ``valid.txt`` into validation and test halves. Model and settings are the
script's defaults (2 layers, 200 units, batch 20, bptt 35, dropout 0.2) and README's
commands; ``--iters`` counts epochs (README: ``--epochs 6``).

Variants, README's commands: ``healthy`` (the LSTM, lr 20), ``healthy_tied``
(``--tied``), ``healthy_transformer`` (``--model Transformer --lr 5``),
``healthy_adamw`` (``--model Transformer --use-optimizer --lr 0.001``); and two
mistakes: ``adamw_default_lr`` (README's AdamW command without ``--lr 0.001``: AdamW
at the script's default lr, 20) and ``lr_x100`` (the LSTM at lr 2000). None of them
took part in designing a rule.

    git --git-dir=$(fetch pytorch/examples) archive HEAD word_language_model | tar -x
    python benchmarks/wlm_trial.py word_language_model --keep /tmp/trials/wlm
    python benchmarks/wlm_trial.py --replay-only /tmp/trials/wlm   # current rules
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from trials import LR_TOO_HIGH, checkout_trial, replace_once, run_recorded

EPOCHS = 6
ACCEPT: dict[str, tuple[str, ...]] = {
    "healthy": (),
    "healthy_tied": (),
    "healthy_transformer": (),
    "healthy_adamw": (),
    "adamw_default_lr": LR_TOO_HIGH,
    "lr_x100": LR_TOO_HIGH,
}
HELPFUL: dict[str, tuple[str, ...]] = {
    "adamw_default_lr": ("learning rate", "lr "),
    "lr_x100": ("learning rate", "lr "),
}
ARGS: dict[str, list[str]] = {
    "healthy": [],
    "healthy_tied": ["--tied"],
    "healthy_transformer": ["--model", "Transformer", "--lr", "5"],
    "healthy_adamw": ["--model", "Transformer", "--use-optimizer", "--lr", "0.001"],
    "adamw_default_lr": ["--model", "Transformer", "--use-optimizer"],
    "lr_x100": ["--lr", "2000"],
}


def patch_main(text: str, job: str, endpoint: str) -> str:
    """main.py with gradwatch attached as README's quickstart says."""
    t = replace_once(
        text,
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)\n",
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)\n"
        "import gradwatch\n"
        f"mon = gradwatch.watch(model, optimizer if args.use_optimizer else None, "
        f"job={job!r}, endpoint={endpoint!r})\n",
        "main.py",
    )
    t = replace_once(
        t,
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)\n",
        "        gw_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)\n",
        "main.py",
    )
    t = replace_once(
        t,
        "        total_loss += loss.item()\n",
        "        gw_lr = {} if args.use_optimizer else {'lr': lr}  # the hand-written update's\n"
        "        mon.log(loss=loss, grad_norm=gw_norm, **gw_lr)\n"
        "        total_loss += loss.item()\n",
        "main.py",
    )
    t = replace_once(
        t,
        "        val_loss = evaluate(val_data)\n",
        "        val_loss = evaluate(val_data)\n        mon.log_eval(loss=val_loss)\n",
        "main.py",
    )
    return t + "\nmon.close()\n"


def data_dir(wlm: Path, out: Path) -> Path:
    """WikiText-2 from the checkout: train on test.txt, validate and test on valid.txt's halves."""
    src = wlm / "data" / "wikitext-2"
    for name in ("valid.txt", "test.txt"):
        if not (src / name).is_file():
            raise SystemExit(f"{src / name} is missing: extract word_language_model with its data")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "test.txt", out / "train.txt")
    lines = (src / "valid.txt").read_text(encoding="utf8").splitlines(keepends=True)
    (out / "valid.txt").write_text("".join(lines[: len(lines) // 2]), encoding="utf8")
    (out / "test.txt").write_text("".join(lines[len(lines) // 2 :]), encoding="utf8")
    return out


def run_variant(wlm: Path, work: Path, traces: Path, variant: str, epochs: int) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    vdir.mkdir(parents=True, exist_ok=True)
    for name in ("data.py", "model.py"):
        shutil.copy(wlm / name, vdir / name)
    data = data_dir(wlm, work / "data")

    def write(endpoint: str) -> list[str]:
        main = (wlm / "main.py").read_text(encoding="utf8")
        (vdir / "main.py").write_text(patch_main(main, f"wlm-{variant}", endpoint))
        return ["main.py", "--data", str(data), "--epochs", str(epochs), *ARGS[variant]]

    return run_recorded(work, traces, f"wlm-{variant}", vdir, write, {})


def main(argv: list[str] | None = None) -> int:
    return checkout_trial(
        __doc__ or "", "wlm", "main.py", (ACCEPT, HELPFUL), EPOCHS, run_variant, argv
    )


if __name__ == "__main__":
    sys.exit(main())
