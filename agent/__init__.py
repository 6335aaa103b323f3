"""gradwatch agent: watch a PyTorch training loop without slowing it down.

Example::

    >>> import torch
    >>> from gradwatch.agent import watch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> mon = watch(model, opt, job="doc", endpoint="tcp://127.0.0.1:1")
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step(); mon.log(loss=1.0)
    >>> mon.close()
    >>> mon.stats.steps_logged
    1

See :mod:`gradwatch.agent.monitor` for what happens on each step.
"""

from gradwatch.agent.commands import ROLLBACK_EXIT_CODE, Rollback, resume_plan
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.gradients import NoLayersError
from gradwatch.agent.monitor import Monitor, MonitorStats
from gradwatch.agent.watching import watch

__all__ = [
    "ROLLBACK_EXIT_CODE",
    "AgentConfig",
    "Monitor",
    "MonitorStats",
    "NoLayersError",
    "Rollback",
    "resume_plan",
    "watch",
]
