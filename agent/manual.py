"""Loops without an optimizer: parameters updated by hand.

pytorch/examples' word_language_model updates its parameters itself::

    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)

There is no ``optimizer.step()`` whose pre-hook could read the gradients, so
``watch(model)`` (no optimizer) reads them at ``Monitor.log()`` instead: call
``log()`` after the update and before the next ``zero_grad()`` (the gradients
of the step are still there; if the loop clips, they are the clipped ones, so
pass the pre-clip total as ``log(grad_norm=clip_grad_norm_(...))``).

The layers are the model's trainable parameters (``requires_grad``), in
``named_parameters()`` order. Update ratios ||dw||/||w|| on cadence steps come
from a copy of the weights taken at the ``log()`` before the cadence step,
i.e. just after the previous update: what changed between the two ``log()``
calls is that step's update. The learning rate is known only if the loop logs
it: ``log(loss=loss, lr=lr)`` sends it as the rate of parameter group 0.

Example::

    >>> import torch
    >>> from gradwatch.agent.manual import ParamsOnly
    >>> stand_in = ParamsOnly(torch.nn.Linear(2, 1))
    >>> [len(g["params"]) for g in stand_in.param_groups]
    [2]
"""

from __future__ import annotations

from typing import Any

import torch


class ParamsOnly:
    """Stands in for the optimizer a loop does not have: one group of the trainable parameters.

    Only ``param_groups`` is read (to pick the layers); it has no learning
    rate, and nothing steps it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.param_groups: list[dict[str, Any]] = [{"params": params}]
