"""A stand-in for ``torch.utils.tensorboard.SummaryWriter`` (tensorboard is not installed):
the scalars a script writes go to ``scalars.jsonl`` in its working folder, one per line,
so a trial can read them (cleanrl_trial.py reads the episodic returns)."""

import json
from typing import Any

import numpy as np


class SummaryWriter:
    def __init__(self, log_dir: str | None = None, **kwargs: Any) -> None:
        self._out = open("scalars.jsonl", "a", encoding="utf8")  # closed in close()

    def add_scalar(self, tag: str, value: Any, step: int | None = None) -> None:
        if hasattr(value, "detach"):  # a tensor, as tensorboard takes it (dqn.py's loss)
            value = value.detach().cpu().numpy()
        self._out.write(
            json.dumps({"tag": tag, "value": np.asarray(value, dtype=float).item(), "step": step})
            + "\n"
        )

    def add_text(self, tag: str, text: str, step: int | None = None) -> None:
        pass

    def close(self) -> None:
        self._out.close()
