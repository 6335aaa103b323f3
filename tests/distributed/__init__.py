"""Real multi-process ``torch.distributed`` (gloo, CPU) jobs that exercise the agent."""
