"""What each activation family's statistics cost on the GPT benchmark, measured side by side.

The agent arms its activation hooks only for the forward pass of a cadence
step, so the cost a run pays is (cost of one armed step) / (steps between
samples). This script measures the armed step against a bare one, interleaved
round-robin in one process so machine drift hits every variant alike:

* ``bare``        -- TinyGPT (benchmarks/tiny_gpt.py: 4 layers, d 256, 4 heads,
  seq 128, vocab 1000, batch 8), forward + backward + AdamW, no hooks;
* ``gelu``        -- hooks on its 4 ``nn.GELU`` modules (output 8x128x1024 each);
* ``functional``  -- the same statistics taken where a functional ``F.gelu``
  would leave them: ``activation_modules={"blocks.*.mlp.2": "gelu"}`` (a forward
  pre-hook reading the input of the Linear after the activation);
* ``silu``        -- TinyGPT with its GELUs swapped for ``nn.SiLU`` (LLaMA's
  gate activation), hooked; its own bare step is ``bare-silu``;
* ``softmax``     -- TinyGPT's attention written out with an ``nn.Softmax``
  module (probabilities 8x4x128x128 per layer), hooked; its own bare step is
  ``bare-softmax`` (TinyGPT's fused attention has no softmax to hook).

Prints median step times, each armed variant's overhead against its bare
twin (the paired median of per-round ratios, which cancels slow drift), and
that overhead spread over a cadence of ``--every`` steps (default 50, the
agent's ``stats_every``). Also prints the median time of one statistics
kernel per family on a tensor of the GPT's shape.

    python benchmarks/activation_cost.py            # ~2 minutes
    python benchmarks/activation_cost.py --rounds 5 # quicker, noisier
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tiny_gpt import Block, TinyGPT  # benchmarks/ is on sys.path when run as a script
from torch import nn

from gradwatch.agent import activations
from gradwatch.agent.activations import ActHooks, measure, measure_rows
from gradwatch.agent.acttargets import find_targets


class SoftmaxAttention(nn.Module):
    """Causal self-attention with the probabilities from an ``nn.Softmax`` module."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, None]:
        b, t, d = q.shape
        qkv = self.qkv(q).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = qkv[0] @ qkv[1].transpose(-2, -1) / (d // self.heads) ** 0.5
        probs = self.softmax(scores.masked_fill(attn_mask, float("-inf")))
        return self.proj((probs @ qkv[2]).transpose(1, 2).reshape(b, t, d)), None


def gpt(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        assert isinstance(block, Block)
        if variant == "silu":
            block.mlp[1] = nn.SiLU()
        if variant == "softmax":
            # A different attention class, swapped in on purpose to time it.
            block.attn = SoftmaxAttention(256, 4)  # type: ignore[assignment]
    return model


def stepper(model: nn.Module, hooks: ActHooks | None) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 1000, (8, 129))

    def step() -> None:
        if hooks is not None:
            hooks.arm()
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 1000), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if hooks is not None:
            hooks.export()  # what a spread sample's training thread pays; the rest ships
            hooks.disarm()

    return step


def armed(
    model: nn.Module, keep: Callable[[str, bool], bool], inputs: dict[str, str] | None = None
) -> ActHooks:
    targets = [t for t in find_targets(model, inputs) if keep(t.kind, t.on_input)]
    assert targets, "nothing to hook"
    return ActHooks(targets, torch.device("cpu"), on_error=None)


def variants() -> dict[str, Callable[[], None]]:
    base, silu, soft = gpt("gelu"), gpt("silu"), gpt("softmax")
    hooked, func = gpt("gelu"), gpt("gelu")
    silu_hooked, soft_hooked = gpt("silu"), gpt("softmax")
    return {
        "bare": stepper(base, None),
        "gelu": stepper(hooked, armed(hooked, lambda kind, on_input: kind == "gelu")),
        "functional": stepper(
            func, armed(func, lambda kind, on_input: on_input, {"blocks.*.mlp.2": "gelu"})
        ),
        "bare-silu": stepper(silu, None),
        "silu": stepper(silu_hooked, armed(silu_hooked, lambda kind, on_input: kind == "silu")),
        "bare-softmax": stepper(soft, None),
        "softmax": stepper(
            soft_hooked, armed(soft_hooked, lambda kind, on_input: kind == "softmax")
        ),
    }


TWIN = {"gelu": "bare", "functional": "bare", "silu": "bare-silu", "softmax": "bare-softmax"}

# Seconds spent inside the statistics kernels during the current step, measured
# directly (low noise; like agent_overhead.py's "inside" timing).
_INSIDE = [0.0]


def _timed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def timed(*args: object) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _INSIDE[0] += time.perf_counter() - t0

    return timed


# Timing wrapper, benchmark only.
activations.measure = _timed(activations.measure)  # type: ignore[assignment]
# Timing wrapper, benchmark only.
activations.measure_rows = _timed(activations.measure_rows)  # type: ignore[assignment]


def kernel_times(repeats: int) -> dict[str, float]:
    """Median seconds of one statistics call per family, on the GPT's tensors."""
    torch.manual_seed(0)
    hidden = torch.randn(8, 128, 1024)
    probs = torch.softmax(torch.randn(8, 4, 128, 128), dim=-1)
    values = torch.empty(3)
    cells = (values, values[0], values[1], values[2])  # a softmax's slots (as ActHooks makes them)
    row = (torch.empty(activations.SAMPLE), torch.empty(()))  # any other module's row
    relu = torch.relu(hidden)
    calls = {
        "relu": lambda: measure(relu, row),
        "gelu": lambda: measure(hidden, row),
        "silu": lambda: measure(hidden, row),
        "softmax": lambda: measure_rows(probs, -1, cells),
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12, help="timed steps per variant (default 12)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--every", type=int, default=50, help="steps between cadence samples")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = variants()
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    inside: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():  # round-robin: drift hits every variant alike
            _INSIDE[0] = 0.0
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            inside[name].append(_INSIDE[0])
    print(f"TinyGPT, CPU, {args.threads} thread(s), {args.rounds} rounds; medians")
    print("armed step: paired median of step-time ratios to the bare twin (noisy); inside: time in")
    print("the statistics kernels per armed step, as a share of the twin's median step (low noise)")
    every = f"1 in {args.every}"
    print(
        f"{'variant':<14}{'step ms':>10}{'armed step':>12}{'inside ms':>11}{'inside':>9}{every:>11}"
    )
    for name, values in times.items():
        line = f"{name:<14}{statistics.median(values) * 1e3:>10.1f}"
        twin = TWIN.get(name)
        if twin is not None:
            ratio = statistics.median(a / b for a, b in zip(values, times[twin], strict=True))
            spent = statistics.median(inside[name])
            share = spent / statistics.median(times[twin]) * 100
            line += (
                f"{(ratio - 1) * 100:>+11.2f}%{spent * 1e3:>11.2f}{share:>+8.2f}%"
                f"{share / args.every:>+10.3f}%"
            )
        print(line)
    kernels = kernel_times(20)
    print(
        "one statistics call (ms, median of 20) on 8x128x1024 (relu/gelu/silu), "
        "8x4x128x128 (softmax):"
    )
    print("  " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in kernels.items()))
    # The low-noise estimate: 4 hooked tensors per armed step (one per layer), as a share
    # of the bare step; the step-time ratios above wobble by more on a busy machine.
    bare = statistics.median(times["bare"])
    print(
        f"kernel estimate, 4 per armed step vs bare step {bare * 1e3:.0f} ms: "
        + "  ".join(
            f"{k} {4 * v / bare * 100:+.2f}% ({4 * v / bare * 100 / args.every:+.3f}% at 1 in "
            f"{args.every})"
            for k, v in kernels.items()
            if k != "relu"
        )
    )


if __name__ == "__main__":
    main()
