"""Which watched parameters lie on one path through the model: its towers, from the loss's graph.

The layer-ratio rules compare the first and last weight matrices' gradient norms,
taking the first and last in parameter order. That is a path through the network
only when the model is one stack. An actor-critic (CleanRL's PPO: ``critic`` then
``actor``, two MLPs side by side), a two-tower retrieval or CLIP-style model has
several: its "first" layer starts one tower and its "last" ends another, and
their ratio follows whatever scales the two objectives (PPO's value loss grows
with the returns): it paged 182 times on a healthy run.

The loss's autograd graph says which parameters feed which: a weight's *use* is
the first node above its ``AccumulateGrad`` (past the transposes, views and casts
of the weight alone) that also reaches other parameters, and everything that use
reaches is upstream of it, on its path. Parameters joined that way form a tower.
Scalars and other parameters of role ``other`` (a learned temperature that scales
the product of two towers) join nothing; tied weights do (a GPT's LM head reaches
its whole stack). :func:`towers_of` walks the graph once, after the first logged
loss that has one; its nodes are there after ``backward()`` (only the tensors they
saved are freed). Nothing is read from the device.

Example::

    >>> import torch
    >>> a, c = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    >>> x = torch.randn(2, 3)
    >>> loss = a(x).sum() + c(x).pow(2).sum()
    >>> params = [a.weight, a.bias, c.weight, c.bias]
    >>> towers_of(loss, params, ("weight", "bias", "weight", "bias"))
    (0, 0, 1, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Graphs above this many nodes are not walked: the towers stay unknown and the rules
# take parameter order, as they did before. A one-off cost on the training thread:
# ~2.5 us a node here (benchmarks/tiny_gpt.py with 96 blocks: 5.4k nodes, 1,157
# parameters, 13 ms), so at most ~0.5 s.
MAX_NODES = 200_000
# Roles whose uses join towers (see the module docstring): not "other".
JOINING = frozenset({"weight", "embedding", "tied", "norm", "bias"})


def towers_of(loss: Any, params: Sequence[torch.Tensor], roles: Sequence[str]) -> tuple[int, ...]:
    """Each parameter's tower (0, 1, ... in order of first appearance; -1: in none, as a
    parameter the loss does not reach or one of role ``other``), or () when the loss has
    no graph, the graph is too large, or the parameters form one tower. ``roles`` align
    with ``params`` (() : all join)."""
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return ()
    index = {id(p): i for i, p in enumerate(params)}
    walked = _walk(root, index)
    if walked is None:
        return ()
    leaves, parents, accumulators = walked
    parent_of = list(range(len(params)))
    members = {i: 1 << i for i in range(len(params))}  # a component's root: its bits

    def find(i: int) -> int:
        while parent_of[i] != i:
            parent_of[i] = parent_of[parent_of[i]]
            i = parent_of[i]
        return i

    def joins(i: int) -> bool:
        return not roles or roles[i] in JOINING

    joining = sum(1 << i for i in range(len(params)) if joins(i))  # a scalar bridges nothing
    for i, acc in accumulators.items():
        if not joins(i):
            continue
        for use in _uses(acc, leaves, parents):
            # One union per component the use reaches beyond i's own: a walk over the
            # bits one by one is quadratic in the parameters (44 ms at 581 of them).
            rest = leaves[use] & joining & ~members[find(i)]
            while rest:
                j = (rest & -rest).bit_length() - 1
                a, b = find(i), find(j)
                parent_of[b] = a
                members[a] |= members.pop(b)
                rest &= ~members[a]
    ids: dict[int, int] = {}
    towers = tuple(
        ids.setdefault(find(i), len(ids)) if i in accumulators and joins(i) else -1
        for i in range(len(params))
    )
    return towers if len(ids) > 1 else ()


def _walk(
    root: Any, index: dict[int, int]
) -> tuple[dict[Any, int], dict[Any, list[Any]], dict[int, Any]] | None:
    """Every node's reachable parameters (a bit per watched parameter), every node's
    parents, and each reached parameter's ``AccumulateGrad``; None past ``MAX_NODES``."""
    leaves: dict[Any, int] = {}
    parents: dict[Any, list[Any]] = {root: []}
    accumulators: dict[int, Any] = {}
    expanded: set[Any] = set()
    # Post-order without recursion (a deep model's graph is thousands of nodes deep): a
    # node is finished once every child is; a child still on the stack below is pushed
    # again above it, and its older entry skipped when it surfaces.
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            bits = 0
            for child, _ in node.next_functions:
                if child is not None:
                    bits |= leaves[child]
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in index:
                i = index[id(variable)]
                bits |= 1 << i
                accumulators[i] = node
            leaves[node] = bits
            continue
        if node in expanded:
            continue
        if len(expanded) >= MAX_NODES:
            return None
        expanded.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in leaves:
                stack.append((child, False))
    return leaves, parents, accumulators


def _uses(acc: Any, leaves: dict[Any, int], parents: dict[Any, list[Any]]) -> list[Any]:
    """The nodes where a parameter meets the rest: above its ``AccumulateGrad``, past the
    nodes that reach only it (transposes, views, casts of the weight alone)."""
    alone = leaves[acc]
    found: list[Any] = []
    seen: set[Any] = set()
    todo = list(parents.get(acc, ()))
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if leaves[node] == alone:
            todo.extend(parents.get(node, ()))
        else:
            found.append(node)
    return found
