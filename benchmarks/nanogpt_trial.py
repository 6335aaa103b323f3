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

Variants: ``healthy``; ``lr_x100`` (learning_rate and min_lr x100);
``init_x0.01`` (every std in model.py's ``_init_weights`` and the c_proj init
x0.01); ``no_step`` (``scaler.step(optimizer)`` never called).

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

import argparse
import inspect
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
# What fits a learning rate far too high. Seed Stage 4 adds weight runaway ("an
# exploding-gradient regime the optimizer partially absorbed") and dead units ("a learning
# rate that pushed units into a dead regime").
LR_TOO_HIGH = (
    "exploding_gradients",
    "lr_too_high",
    "loss_spike",
    "numerical",
    "update_ratio",
    "weight_runaway",
    "dead_units",
)
ACCEPT: dict[str, tuple[str, ...]] = {
    "healthy": (),
    "lr_x100": LR_TOO_HIGH,
    "init_x0.01": ("vanishing_gradients", "dead_pipeline", "update_ratio", "lr_too_low"),
    "no_step": ("dead_pipeline", "update_ratio"),
}
# Advice that would help: words one of the alert's first three next checks should contain.
HELPFUL: dict[str, tuple[str, ...]] = {
    "lr_x100": ("learning rate", "lr "),
    "init_x0.01": ("init",),
    "no_step": ("optimizer.step", "step()"),
}
PAGING = ("warning", "critical")
DATASET_BYTES = 1_000_000


# --------------------------------------------------------------------------- dataset


def local_text(limit: int = DATASET_BYTES) -> str:
    """About ``limit`` characters of ASCII text found on this machine, in a fixed order."""
    sources = sorted(Path("/usr/share/common-licenses").glob("*"))
    stdlib = Path(os.__file__).parent
    sources += sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))
    parts: list[str] = []
    size = 0
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_bytes().decode("ascii", errors="ignore")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    data = "".join(parts)[:limit]
    if len(data) < limit // 2:
        raise SystemExit(f"only {len(data)} characters of local text found; need {limit // 2}+")
    return data


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


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    count = text.count(old)
    if count != 1:
        raise SystemExit(
            f"{where}: expected the line {old!r} once, found it {count} times; "
            "this nanoGPT version differs from the one the trial was written for"
        )
    return text.replace(old, new)


def agent_takes_step() -> bool:
    """Whether the agent takes the loop's own step numbers (``watch(start_step=)``, C4)."""
    import gradwatch

    return "start_step" in inspect.signature(gradwatch.watch).parameters


def patch_train(text: str, job: str, endpoint: str, variant: str, user_step: bool) -> str:
    """train.py with the README's quickstart lines, and the variant's bug."""
    start = ", start_step=iter_num" if user_step else ""  # steps.py: nanoGPT's own numbers
    t = _replace_once(
        text,
        "checkpoint = None # free up memory\n",
        "checkpoint = None # free up memory\n"
        "import gradwatch\n"
        f"mon = gradwatch.watch(model, optimizer, job={job!r}, endpoint={endpoint!r}{start})\n",
        "train.py",
    )
    t = _replace_once(
        t,
        "        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
        "        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n",
        "train.py",
    )
    t = _replace_once(
        t,
        "    scaler.update()\n",
        "    scaler.update()\n"
        "    mon.log(loss=loss * gradient_accumulation_steps, grad_norm=grad_norm)\n",
        "train.py",
    )
    t = _replace_once(
        t,
        "        losses = estimate_loss()\n",
        "        losses = estimate_loss()\n        mon.log_eval(loss=losses['val'])\n",
        "train.py",
    )
    t = _replace_once(
        t,
        "if ddp:\n    destroy_process_group()\n",
        "mon.close()\nif ddp:\n    destroy_process_group()\n",
        "train.py",
    )
    if variant == "no_step":
        t = _replace_once(
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
    t = _replace_once(
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
    return []


# --------------------------------------------------------------------------- running


def start_collector(work: Path, record: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = work / "collector-ready.json"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradwatch",
            "collector",
            "--listen",
            "tcp://127.0.0.1:*",
            "--metrics-addr",
            "127.0.0.1:0",
            "--record",
            str(record),
            "--ready-file",
            str(ready),
            "--log-level",
            "WARNING",
        ],
        stdout=open(work / "collector.log", "ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size:
            try:
                info = json.loads(ready.read_text())
            except json.JSONDecodeError:
                time.sleep(0.1)  # written but not complete yet
                continue
            return proc, str(info.get("endpoint") or info.get("listen"))
        if proc.poll() is not None:
            raise SystemExit(
                f"the collector exited ({proc.returncode}); see {work / 'collector.log'}"
            )
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the collector was not ready within 60 s; see {work / 'collector.log'}")


def stop_collector(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def run_recorded(
    work: Path,
    traces: Path,
    job: str,
    vdir: Path,
    write: Callable[[str], list[str]],
    env: dict[str, str],
) -> Path:
    """Run one training script in ``vdir`` under a fresh recording collector; return its trace.

    ``write(endpoint)`` writes the patched script and returns its arguments.
    """
    proc, endpoint = start_collector(work, traces)
    try:
        cmd = [sys.executable, *write(endpoint)]
        full = dict(
            os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env
        )
        started = time.monotonic()
        with open(vdir / "train.log", "wb") as log:
            rc = subprocess.run(
                cmd, cwd=vdir, env=full, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        print(
            f"[{job}] {cmd[1]} exit {rc} after {time.monotonic() - started:.0f} s "
            f"(log {vdir / 'train.log'})",
            file=sys.stderr,
        )
    finally:
        stop_collector(proc)
    trace = traces / f"{job}.jsonl"
    if not trace.exists():
        raise SystemExit(f"no trace at {trace}; see {work / 'collector.log'}")
    (traces / f"{job}.train.log").write_bytes((vdir / "train.log").read_bytes())
    return trace


# --------------------------------------------------------------------------- scoring


@dataclass
class Scored:
    variant: str
    alerts: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""

    @property
    def paging(self) -> list[dict[str, Any]]:
        return [a for a in self.alerts if a["severity"] in PAGING]


def replay(trace: Path, rules: Path | None) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "gradwatch", "replay", "--json", str(trace)]
    if rules is not None:
        cmd[4:4] = ["--rules", str(rules)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [r["alert"] for r in rows if r["transition"] == "firing"]


def score(
    variant: str,
    alerts: list[dict[str, Any]],
    accepts: dict[str, tuple[str, ...]] = ACCEPT,
    helpful: dict[str, tuple[str, ...]] = HELPFUL,
) -> Scored:
    """The variant's verdict: its fitting categories ``accepts``, its helpful advice ``helpful``."""
    s = Scored(variant, alerts)
    accept = accepts.get(variant, ())
    if not accept:
        n = len(s.paging)
        s.verdict = "PASS: no page" if n == 0 else f"FAIL: {n} false page(s)"
        return s
    hits = sorted((a for a in s.paging if a["category"] in accept), key=lambda a: a["step"])
    if hits:
        first = hits[0]
        s.verdict = f"CAUGHT by {first['rule']} [{first['category']}] at step {first['step']}"
        useful = [a for a in hits if _helps(helpful.get(variant, ()), a)]
        s.verdict += (
            "; helpful advice "
            + (
                "first"
                if useful[:1] == [first]
                else f"from {useful[0]['rule']} at step {useful[0]['step']}"
            )
            if useful
            else "; no alert's first checks would help"
        )
    else:
        s.verdict = f"MISSED: no warning-or-higher alert in {accept}"
    return s


def _helps(words: tuple[str, ...], a: dict[str, Any]) -> bool:
    checks = list((a.get("diagnosis") or {}).get("next_checks") or [])[:3]
    return any(w in c.lower() for c in checks for w in words)


def _first_check(a: dict[str, Any]) -> str:
    d = a.get("diagnosis") or {}
    checks = d.get("next_checks") or []
    return f"verdict {d.get('verdict', '-')}; first check: {checks[0] if checks else '-'}"


def table(results: list[Scored], max_rows: int = 12) -> str:
    lines = [
        f"{'variant':<12} {'rule':<34} {'category':<20} {'severity':<9} {'step':>5}  diagnosis",
        "-" * 118,
    ]
    for r in results:
        shown = sorted(r.alerts, key=lambda a: a["step"])
        for a in shown[:max_rows]:
            lines.append(
                f"{r.variant:<12} {a['rule']:<34} {a['category']:<20} {a['severity']:<9} "
                f"{a['step']:>5}  {_first_check(a)[:120]}"
            )
        if len(shown) > max_rows:
            lines.append(f"{r.variant:<12} ... {len(shown) - max_rows} more firing(s)")
        if not shown:
            lines.append(f"{r.variant:<12} (no alert)")
        lines.append(
            f"{r.variant:<12} => {r.verdict}  ({len(r.alerts)} firing(s), "
            f"{len(r.paging)} warning-or-higher)"
        )
        lines.append("")
    return "\n".join(lines)


def trial_args(
    doc: str,
    checkout: str | None,
    variants: dict[str, tuple[str, ...]],
    iters: int,
    argv: list[str] | None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[str]]:
    """A trial's command line (a checkout positional named ``checkout``, if any), its variants."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if checkout is not None:
        p.add_argument(checkout, nargs="?", type=Path, help=f"a {checkout} checkout")
    names = ",".join(variants)
    p.add_argument("--variants", default=names, help="comma-separated, of " + names)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--keep", type=Path, help="keep traces and train logs in this folder")
    p.add_argument(
        "--replay-only",
        type=Path,
        metavar="DIR",
        help="skip training: replay the traces kept in DIR with the current rules",
    )
    p.add_argument("--rules", type=Path, help="rule file for replay (default: the packaged one)")
    p.add_argument("--json", action="store_true", help="print every firing alert as JSON too")
    args = p.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v]
    unknown = set(chosen) - set(variants)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {list(variants)}")
    return p, args, chosen


def report(
    traces: Path,
    prefix: str,
    variants: list[str],
    args: argparse.Namespace,
    accepts: dict[str, tuple[str, ...]] = ACCEPT,
    helpful: dict[str, tuple[str, ...]] = HELPFUL,
) -> None:
    """Replay each variant's trace with the current rules; print the table (and JSON)."""
    results = []
    for v in variants:
        trace = traces / f"{prefix}-{v}.jsonl"
        if not trace.exists():
            print(f"[{v}] no trace at {trace}; skipped", file=sys.stderr)
            continue
        results.append(score(v, replay(trace, args.rules), accepts, helpful))
    print(table(results))
    if args.json:
        print(json.dumps({r.variant: r.alerts for r in results}, indent=1, default=str))


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
    report(traces, "nanogpt", variants, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
