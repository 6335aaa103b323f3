"""A trial on code nobody here wrote: karpathy/nanoGPT with the README's quickstart lines.

Takes a path to a nanoGPT checkout (never copied into this repository; CI never
needs it). In a temporary working directory it:

1. builds a character-level dataset from local text (the licences in
   /usr/share/common-licenses, then Python standard-library sources, about
   1 MB, ASCII only) in the format of nanoGPT's data/shakespeare_char/prepare.py
   (train.bin/val.bin as uint16, meta.pkl with vocab_size/itos/stoi): there is
   no network, so prepare.py's download cannot run;
2. copies train.py and model.py and adds gradwatch by text patching, as a user
   would from the README's quickstart: ``watch()`` after the optimizer is made,
   ``grad_norm = clip_grad_norm_(...)``, ``mon.log(loss=..., grad_norm=...)``
   after the optimizer step, ``mon.log_eval(loss=losses['val'])`` after
   ``estimate_loss()``, ``mon.close()`` at the end;
3. runs each variant (config/train_shakespeare_char.py plus nanoGPT's README
   CPU line, gradient_accumulation_steps=2, 1,500 iterations) against a real
   ``gradwatch collector --record`` subprocess, then ``gradwatch replay --json``
   on the recorded trace;
4. prints one table: variant, every alert that fired (rule, category,
   severity, step), and its diagnosis (verdict and first next check), and a
   score: on ``healthy`` every warning-or-higher alert is a false page; each
   broken variant should raise a warning-or-higher alert of a fitting category.

Variants: ``healthy``; ``healthy_compiled`` (nanoGPT's default ``compile=True``, and
``watch()`` after the compile as README says); ``lr_x100`` (learning_rate and min_lr
x100); ``init_x0.01`` (every std in model.py's ``_init_weights`` and the c_proj init
x0.01); ``no_step`` (``scaler.step(optimizer)`` never called); ``reinit_mid``
(``raw_model.apply(raw_model._init_weights)`` run again at half the run's iterations:
every Linear and Embedding back at its init, the training so far lost in one step).

    OMP_NUM_THREADS=1 python benchmarks/nanogpt_trial.py /tmp/nanogpt --keep /tmp/trials/run1
    python benchmarks/nanogpt_trial.py --replay-only /tmp/trials/run1   # current rules, old traces

``--replay-only DIR`` re-scores traces kept by ``--keep`` with the current rules
(the agent's output does not change with the rules, so no retraining is needed).
Step alignment: nanoGPT's ``iter_num`` starts at 0 and the first ``mon.log``
closes iteration 0, so gradwatch's own count is ``iter_num + 1``; an agent that
takes the loop's numbers (``watch(start_step=)``, CONTRACTS C4) is given
``start_step=iter_num`` and its steps are nanoGPT's. stderr says which one ran.
"""

from __future__ import annotations

import inspect
import json
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from trials import LR_TOO_HIGH, local_text, replace_once, report, run_recorded, trial_args

ITERS = 1500
# nanoGPT README's CPU line, plus the trial's gradient accumulation (issue 13).
CPU_LINE = [
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
    "--gradient_accumulation_steps=2",
]
ACCEPT: dict[str, tuple[str, ...]] = {
    "healthy": (),
    "healthy_compiled": (),
    "lr_x100": LR_TOO_HIGH,
    "init_x0.01": ("vanishing_gradients", "dead_pipeline", "update_ratio", "lr_too_low"),
    "no_step": ("dead_pipeline", "update_ratio"),
    "reinit_mid": ("loss_spike",),
}
# Advice that would help: words one of the alert's first three next checks should contain.
HELPFUL: dict[str, tuple[str, ...]] = {
    "lr_x100": ("learning rate", "lr "),
    "init_x0.01": ("init",),
    "no_step": ("optimizer.step", "step()"),
    "reinit_mid": ("checkpoint", "apply(init)"),
}
# --------------------------------------------------------------------------- dataset


def prepare_char_dataset(dst: Path) -> dict[str, int]:
    """Write train.bin/val.bin/meta.pkl as nanoGPT's shakespeare_char/prepare.py would."""
    data = local_text()
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = dict(enumerate(chars))
    n = len(data)
    train_ids = np.array([stoi[c] for c in data[: int(n * 0.9)]], dtype=np.uint16)
    val_ids = np.array([stoi[c] for c in data[int(n * 0.9) :]], dtype=np.uint16)
    dst.mkdir(parents=True, exist_ok=True)
    train_ids.tofile(dst / "train.bin")
    val_ids.tofile(dst / "val.bin")
    with open(dst / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return {"chars": n, "vocab": len(chars), "train": len(train_ids), "val": len(val_ids)}


# --------------------------------------------------------------------------- patching


def agent_takes_step() -> bool:
    """Whether the agent takes the loop's own step numbers (``watch(start_step=)``, C4)."""
    import gradwatch

    return "start_step" in inspect.signature(gradwatch.watch).parameters


def patch_train(text: str, job: str, endpoint: str, variant: str, user_step: bool) -> str:
    """train.py with the README's quickstart lines, and the variant's bug."""
    start = ", start_step=iter_num" if user_step else ""  # steps.py: nanoGPT's own numbers
    attach = (
        "import gradwatch\n"
        f"mon = gradwatch.watch(model, optimizer, job={job!r}, endpoint={endpoint!r}{start})\n"
    )
    # README: compile before watch(); nanoGPT compiles (and wraps DDP) after the optimizer.
    after = (
        "if ddp:\n    model = DDP(model, device_ids=[ddp_local_rank])\n"
        if variant == "healthy_compiled"
        else "checkpoint = None # free up memory\n"
    )
    t = replace_once(text, after, after + attach, "train.py")
    t = replace_once(
        t,
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
        "        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
        "train.py",
    )
    t = replace_once(
        t,
        "    scaler.update()\n",
        "    scaler.update()\n"
        "    mon.log(loss=loss * gradient_accumulation_steps, grad_norm=grad_norm)\n",
        "train.py",
    )
    t = replace_once(
        t,
        "        losses = estimate_loss()\n",
        "        losses = estimate_loss()\n        mon.log_eval(loss=losses['val'])\n",
        "train.py",
    )
    t = replace_once(
        t,
        "if ddp:\n    destroy_process_group()\n",
        "mon.close()\nif ddp:\n    destroy_process_group()\n",
        "train.py",
    )
    if variant == "reinit_mid":
        t = replace_once(
            t,
            "while True:\n",
            "while True:\n"
            "    if iter_num == max_iters // 2:  # the bug: the init run again mid-run\n"
            "        raw_model.apply(raw_model._init_weights)\n",
            "train.py",
        )
    if variant == "no_step":
        t = replace_once(
            t,
            "    scaler.step(optimizer)\n",
            "    pass  # the bug: scaler.step(optimizer) is never called\n",
            "train.py",
        )
    return t


def patch_model(text: str, variant: str) -> str:
    if variant != "init_x0.01":
        return text
    t = text.replace("std=0.02)", "std=0.02 * 0.01)")
    t = replace_once(
        t,
        "std=0.02/math.sqrt(2 * config.n_layer))",
        "std=0.02 * 0.01/math.sqrt(2 * config.n_layer))",
        "model.py",
    )
    if t.count("0.02 * 0.01") < 3:
        raise SystemExit("model.py: _init_weights no longer has the two std=0.02 inits")
    return t


def variant_args(variant: str) -> list[str]:
    if variant == "lr_x100":
        return ["--learning_rate=0.1", "--min_lr=0.01"]  # the config's 1e-3 and 1e-4, x100
    if variant == "healthy_compiled":
        return ["--compile=True"]  # nanoGPT's own default; after CPU_LINE's False
    return []


# --------------------------------------------------------------------------- running


def run_variant(
    nanogpt: Path, work: Path, traces: Path, variant: str, iters: int, user_step: bool
) -> Path:
    """Train one variant under a fresh recording collector; return its trace."""
    vdir = work / variant
    vdir.mkdir(parents=True, exist_ok=True)
    for name in ("configurator.py",):
        shutil.copy(nanogpt / name, vdir / name)
    shutil.copytree(nanogpt / "config", vdir / "config", dirs_exist_ok=True)
    data = vdir / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    for name in ("train.bin", "val.bin", "meta.pkl"):
        shutil.copy(work / "dataset" / name, data / name)

    def write(endpoint: str) -> list[str]:
        job = f"nanogpt-{variant}"
        (vdir / "train.py").write_text(
            patch_train((nanogpt / "train.py").read_text(), job, endpoint, variant, user_step)
        )
        (vdir / "model.py").write_text(patch_model((nanogpt / "model.py").read_text(), variant))
        return [
            "train.py",
            "config/train_shakespeare_char.py",
            *CPU_LINE,
            f"--max_iters={iters}",
            f"--lr_decay_iters={iters}",
            *variant_args(variant),
        ]

    return run_recorded(work, traces, f"nanogpt-{variant}", vdir, write, {})


def main(argv: list[str] | None = None) -> int:
    p, args, variants = trial_args(__doc__ or "", "nanogpt", ACCEPT, ITERS, argv)
    if args.replay_only is None and args.nanogpt is None:
        p.error("give a nanoGPT checkout, or --replay-only DIR")

    if args.replay_only is not None:
        traces = args.replay_only
    else:
        if not (args.nanogpt / "train.py").exists():
            p.error(f"{args.nanogpt} has no train.py; give the root of a nanoGPT checkout")
        work = Path(tempfile.mkdtemp(prefix="nanogpt-trial-"))
        traces = args.keep or work / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        info = prepare_char_dataset(work / "dataset")
        user_step = agent_takes_step()
        print(
            f"work dir {work}; dataset {info}; gradwatch step = "
            f"{'iter_num (start_step=iter_num)' if user_step else 'iter_num + 1'}",
            file=sys.stderr,
        )
        (traces / "trial.json").write_text(
            json.dumps(
                {
                    "dataset": info,
                    "iters": args.iters,
                    "variants": variants,
                    "gradwatch_step": "iter_num" if user_step else "iter_num + 1",
                }
            )
        )
        for v in variants:
            run_variant(args.nanogpt, work, traces, v, args.iters, user_step)
    report(traces, "nanogpt", variants, args, ACCEPT, HELPFUL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
