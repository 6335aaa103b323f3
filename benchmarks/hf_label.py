"""Label a Hugging Face ``trainer_state.json`` by the corpus README's fixed rules, from its log.

The calibration corpus (``../shared/data/hf-trainer-logs``) was labelled by
fixed rules before any monitor saw it; this is those rules as code, so a
held-out sample can be labelled the same way *before* the rules replay it.
Stdlib only and no gradwatch import: the labeler must not know the monitor.

Notation (README): ``n`` finite logged training losses; ``k = max(3,
ceil(n/10))``; ``start``/``end`` the median of the first/last ``k`` losses;
``m`` the minimum of a centred rolling median over ``k`` logs (``k + 1`` when
``k`` is even, so the window has a centre; partial windows at the ends).

* broken: B1 non-finite loss or eval loss, or a non-finite grad norm that is
  not an isolated fp16 overflow skip; B2 loss exactly 0.0 on the last 3 logs
  or on 20%+ of them; B3 a grad norm > 100x the median and > 10x the maximum of
  the prior 50 positive norms, with the loss worse after it; B4 ``end > 1.1
  start``; B5 ``end >= 1.3 m`` with a rise of at least 25% of the earlier drop;
  B6 the last eval >= 1.25x the best while the training loss fell to <= 0.5x
  its level at the best eval.
* unclear: U1 flat within 5% over 50+ logs; U2 weaker B6; U3 an RL objective;
  U4 weaker B3; U5 weaker B5 (the README names these without numbers; the
  weaker bounds are this module's, see the constants).
* healthy: everything else.

Run::

    .venv/bin/python benchmarks/hf_label.py --check            # agreement with the shared corpus
    .venv/bin/python benchmarks/hf_label.py a.json b.json.gz   # label files
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "hf-trainer-logs"

# README bounds.
ZERO_SHARE = 0.2  # B2: exactly 0.0 on 20%+ of logs
B3_MEDIAN, B3_MAX, B3_PRIOR = 100.0, 10.0, 50  # B3: > 100x median and > 10x max of prior 50
B4_RISE = 1.1  # B4: end > 1.1 x start
B5_RISE, B5_SHARE = 1.3, 0.25  # B5: end >= 1.3 m, rise >= 25% of the drop
B6_EVAL, B6_TRAIN = 1.25, 0.5  # B6: last eval >= 1.25 best, train <= 0.5x its level then
FLAT, FLAT_LOGS = 0.05, 50  # U1: flat within 5% over 50+ logs
# The README's "weaker versions" carry no numbers. U2's bound is read off the corpus's own U2
# reasons (eval 1.12x-1.26x of its best while the training loss still fell); U4 and U5 halve
# the margins of B3 and B5 and keep the shape.
U2_EVAL = 1.1  # last eval >= 1.1x best while the training loss fell at all
U4_MEDIAN, U4_MAX = 10.0, 3.0
U5_RISE = 1.15
# Keys only a reinforcement-learning trainer (TRL's GRPO/PPO) logs on training rows.
RL_KEYS = ("reward", "kl", "reward_std", "objective/kl")


@dataclass(frozen=True, slots=True)
class Curves:
    """What a log holds, split by kind; each list is (step, value) in log order."""

    losses: list[tuple[int, float]]  # finite training losses
    nonfinite_losses: int
    norms: list[tuple[int, float | None, bool]]  # (step, norm, loss finite) per training row
    evals: list[tuple[int, float]]
    nonfinite_evals: int
    rl: bool


@dataclass(frozen=True, slots=True)
class Label:
    label: str  # broken, unclear or healthy
    why: str  # codes and the numbers that decided them


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def curves(rows: Sequence[Mapping[str, Any]]) -> Curves:
    """Split ``log_history`` rows: a training row has ``loss``, an eval row ``eval_loss``."""
    losses: list[tuple[int, float]] = []
    norms: list[tuple[int, float | None, bool]] = []
    evals: list[tuple[int, float]] = []
    bad_loss = bad_eval = 0
    rl = False
    for row in rows:
        step = row.get("step")
        step = step if isinstance(step, int) else -1
        if "loss" in row:
            loss = _number(row.get("loss"))
            finite = loss is not None and math.isfinite(loss)
            if loss is not None and finite:
                losses.append((step, loss))
            elif loss is not None:
                bad_loss += 1
            rl = rl or any(key in row for key in RL_KEYS) or (finite and (loss or 0.0) < 0)
            if "grad_norm" in row:
                norms.append((step, _number(row.get("grad_norm")), finite))
        if "eval_loss" in row:
            value = _number(row.get("eval_loss"))
            if value is not None and math.isfinite(value):
                evals.append((step, value))
            elif value is not None:
                bad_eval += 1
    return Curves(losses, bad_loss, norms, evals, bad_eval, rl)


def _g(x: float) -> str:
    return f"{x:.4g}"


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def window(n: int) -> int:
    """README's ``k``."""
    return max(3, math.ceil(n / 10))


def rolling(xs: Sequence[float], k: int) -> list[float]:
    """A centred rolling median over ``k`` logs (``k + 1`` when even, so it has a centre); the
    ends use the part of the window that exists. This reproduces every ``best`` of runs.csv."""
    half = (k if k % 2 else k + 1) // 2
    return [_median(xs[max(0, i - half) : i + half + 1]) for i in range(len(xs))]


def b1(c: Curves) -> str | None:
    if c.nonfinite_losses or c.nonfinite_evals:
        return f"B1 non-finite loss on {c.nonfinite_losses} logs, eval loss on {c.nonfinite_evals}"
    for i, (step, norm, loss_finite) in enumerate(c.norms):
        if norm is None or math.isfinite(norm):
            continue
        # A GradScaler skip: the loss stayed finite and the run logs finite norms again (two
        # skips in a row while the scale calibrates at the start are common).
        later = (n for _, n, _ in c.norms[i + 1 :] if n is not None and math.isfinite(n))
        if not loss_finite or next(later, None) is None:
            return f"B1 non-finite grad norm at step {step} and no finite one after it"
    return None


def b2(xs: Sequence[float]) -> str | None:
    zeros = sum(x == 0.0 for x in xs)
    last3 = len(xs) >= 3 and all(x == 0.0 for x in xs[-3:])
    if last3 or zeros >= ZERO_SHARE * len(xs):
        return f"B2 loss exactly 0.0 on {zeros}/{len(xs)} logs (last 3 zero: {last3})"
    return None


def spike(c: Curves, by_median: float, by_max: float) -> tuple[int, float, float] | None:
    """The first grad norm above ``by_median`` x the median and ``by_max`` x the maximum of the
    prior positive norms, with the loss worse after it: (step, norm, prior median)."""
    loss_at = {step: i for i, (step, _) in enumerate(c.losses)}
    xs = [x for _, x in c.losses]
    k = window(len(xs))
    prior: list[float] = []
    for step, norm, _ in c.norms:
        if norm is None or not math.isfinite(norm):
            continue
        if len(prior) >= 3:
            recent = prior[-B3_PRIOR:]
            med = _median(recent)
            i = loss_at.get(step)
            if norm > by_median * med and norm > by_max * max(recent) and i is not None:
                before, after = xs[max(0, i - k) : i], xs[i + 1 : i + 1 + k]
                if before and after and _median(after) > _median(before):
                    return step, norm, med
        if norm > 0:
            prior.append(norm)
    return None


def train_level(c: Curves, step: int) -> float:
    """The training loss level at ``step``: the rolling median at the last loss logged by then."""
    xs = [x for _, x in c.losses]
    i = max((j for j, (s, _) in enumerate(c.losses) if s <= step), default=0)
    return rolling(xs, window(len(xs)))[i]


def overfit(c: Curves) -> tuple[float, float, int, float] | None:
    """(last/best eval, best eval, its step, train level there) when the last eval is worse."""
    if len(c.evals) < 2:
        return None
    best_step, best = min(c.evals, key=lambda e: e[1])
    last = c.evals[-1][1]
    if best <= 0 or last <= best:
        return None
    return last / best, best, best_step, train_level(c, best_step)


def label(rows: Sequence[Mapping[str, Any]]) -> Label:
    """The README label of one ``log_history``."""
    c = curves(rows)
    broken: list[str] = []
    if (code := b1(c)) is not None:
        broken.append(code)
    if c.rl:
        return (
            Label("broken", broken[0])
            if broken
            else Label("unclear", "U3 RL objective (loss is not a progress measure)")
        )
    xs = [x for _, x in c.losses]
    if not xs:
        return Label("broken", broken[0]) if broken else Label("unclear", "no training loss")
    n, k = len(xs), window(len(xs))
    start, end, m = _median(xs[:k]), _median(xs[-k:]), min(rolling(xs, k))
    if (code := b2(xs)) is not None:
        broken.append(code)
    if (hit := spike(c, B3_MEDIAN, B3_MAX)) is not None:
        broken.append(f"B3 grad norm {_g(hit[1])} at step {hit[0]} = {_g(hit[1] / hit[2])}x median")
    if end > B4_RISE * start:
        broken.append(f"B4 end {_g(end)} > 1.1 x start {_g(start)}")
    drop, rise = start - m, end - m
    if end >= B5_RISE * m and rise >= B5_SHARE * drop:
        share = f"{rise / drop:.0%}" if drop > 0 else "no earlier drop"
        broken.append(f"B5 end {_g(end)} >= 1.3 x best level {_g(m)} (rise {share} of drop)")
    gap = overfit(c)
    if gap is not None:
        ratio, best, at, level = gap
        if ratio >= B6_EVAL and end <= B6_TRAIN * level:
            last = c.evals[-1][1]
            broken.append(
                f"B6 eval {_g(last)} = {ratio:.2f}x best {_g(best)}@{at} "
                f"while train fell {_g(level)}->{_g(end)}"
            )
    if broken:
        return Label("broken", " | ".join(broken))
    if gap is not None and gap[0] >= U2_EVAL and end < gap[3]:
        return Label(
            "unclear", f"U2 eval {gap[0]:.2f}x best while train fell to {end / gap[3]:.2f}x"
        )
    if (hit := spike(c, U4_MEDIAN, U4_MAX)) is not None:
        return Label("unclear", f"U4 grad norm {_g(hit[1])} at step {hit[0]} (weaker B3)")
    if end >= U5_RISE * m and rise >= B5_SHARE * drop:
        return Label("unclear", f"U5 end {_g(end)} >= 1.15 x best level {_g(m)} (weaker B5)")
    if n >= FLAT_LOGS and abs(end - start) <= FLAT * start:
        return Label("unclear", f"U1 flat: start {_g(start)} -> end {_g(end)} over {n} logs")
    return Label("healthy", f"start {_g(start)} -> end {_g(end)} (best {_g(m)})")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """``log_history`` of a ``trainer_state.json`` (plain or gzipped); ValueError if none."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        state = json.load(f)
    rows = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no 'log_history' list; pass a Trainer's trainer_state.json")
    return [r for r in rows if isinstance(r, dict)]


def check(corpus: Path = CORPUS) -> list[tuple[str, str, Label]]:
    """(file, runs.csv label, this module's label) for every run of ``corpus``."""
    with (corpus / "runs.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [(r["file"], r["label"], label(read_rows(corpus / "runs" / r["file"]))) for r in rows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="trainer_state.json(.gz) to label")
    parser.add_argument("--check", action="store_true", help="compare with the corpus's labels")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="corpus with runs.csv")
    args = parser.parse_args(argv)
    if args.check:
        results = check(args.corpus)
        for file, want, got in results:
            mark = "  " if got.label == want else "!!"
            print(f"{mark} {want:<8} {got.label:<8} {file}: {got.why}")
        agree = sum(got.label == want for _, want, got in results)
        print(f"agreement: {agree}/{len(results)}")
    for path in args.files:
        got = label(read_rows(path))
        print(f"{got.label},{got.why}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
