"""A LoRA fine-tune under gradwatch: the HF trial's GPT-2, pretrained, then adapted.

The GPT-2 of ``hf_trainer_trial.py`` (whose runner and data this uses) is pretrained
unwatched for 600 steps on the first half of the text; then its weights are frozen and
LoRA adapters (rank 8, alpha 16, PEFT's init: A Kaiming-uniform, B zero) wrap every
attention projection, and only those train, on the rest of the text, for 600 steps, in
a plain loop watched by ``gradwatch.watch(model, optimizer)``. No PEFT install: the
adapter is 10 lines. Both variants are healthy controls: every warning is a false page.

Variants: ``lr_x0.4`` (AdamW 2e-4, a usual LoRA rate); ``lr_x4`` (2e-3).
Found with it (2026-12-06): LayersLagging paged at step 2 of the 2e-4 run, reading the
fresh B matrices' update over almost nothing as the model's pace.

    OMP_NUM_THREADS=1 python benchmarks/lora_trial.py --keep /tmp/trials/lora1
    python benchmarks/lora_trial.py --replay-only /tmp/trials/lora1
"""

from __future__ import annotations

import sys

from hf_trainer_trial import DATA, run_trial

ACCEPT: dict[str, tuple[str, ...]] = {"lr_x0.4": (), "lr_x4": ()}

# The training script, written into the trial's work dir; {…} are filled per variant.
SCRIPT = (
    DATA
    + """\
import math
from torch import nn
import gradwatch

model = GPT2LMHeadModel(GPT2)
blocks = data[: n * BLOCK].view(n, BLOCK)
opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
pick = torch.Generator().manual_seed(1)
for _ in range(600):  # pretraining, unwatched
    x = blocks[torch.randint(0, n // 2, (16,), generator=pick)]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


class LoRA(nn.Module):
    def __init__(self, base, r=8, alpha=16):
        super().__init__()
        self.base, self.scale = base, alpha / r
        fan_in, fan_out = base.weight.shape  # transformers' Conv1D: (in, out)
        self.lora_A = nn.Parameter(torch.empty(r, fan_in))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(fan_out, r))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


model.requires_grad_(False)
for block in model.transformer.h:
    block.attn.c_attn, block.attn.c_proj = LoRA(block.attn.c_attn), LoRA(block.attn.c_proj)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr={lr!r})
mon = gradwatch.watch(model, opt, job={job!r}, endpoint={endpoint!r})
for _ in range({iters}):
    x = blocks[n // 2 + torch.randint(0, cut - n // 2, (16,), generator=pick)]
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    mon.log(loss=loss.detach())
    opt.zero_grad()
mon.close()
print("final loss", float(loss))
"""
)


def main(argv: list[str] | None = None) -> int:
    return run_trial(__doc__ or "", "lora", SCRIPT, ACCEPT, argv, iters=600)


if __name__ == "__main__":
    sys.exit(main())
