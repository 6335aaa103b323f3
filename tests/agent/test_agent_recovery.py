"""agent/recovery.py: carrying on after the model changed under the agent."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from gradwatch.agent.gradients import GradReader
from gradwatch.agent.layout import MISSING_I32
from gradwatch.agent.recovery import Follower, Notice, NoticeBoard, PartialReader, recover


def reader_of(model: nn.Module) -> GradReader:
    return GradReader.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_nothing_changed_means_no_recovery() -> None:
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    assert recover(reader_of(model)) is None  # the failure was the agent's own


def test_a_device_move_turns_gradient_and_weight_norms_off_and_says_why() -> None:
    model = nn.Linear(3, 2)
    # As if the buffer had been made on another device than the parameters now live on.
    moved = dataclasses.replace(reader_of(model), device=torch.device("meta"))
    fixed = recover(moved)
    assert fixed is not None
    new, notice = fixed
    assert isinstance(new, PartialReader) and new.weights_reader is None
    assert notice is not None and not notice.optional and "model.to(device)" in notice.reason
    assert new.snapshot_weights() == []


def test_sparse_layers_are_missing_and_the_others_exact() -> None:
    emb, head = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    model = nn.Sequential(emb, head)
    reader = reader_of(model)
    model(torch.tensor([1, 2])).sum().backward()
    fixed = recover(reader)
    assert fixed is not None
    new, notice = fixed
    row = torch.empty(3)
    new.read_into(row)
    assert row.view(torch.int32)[0].item() == MISSING_I32
    assert torch.allclose(row[1:], torch.stack([head.weight.grad.norm(), head.bias.grad.norm()]))
    assert notice is not None and "0.weight" in notice.reason


def test_follower_adopts_only_optimizers_holding_the_watched_parameters() -> None:
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    watched = torch.optim.SGD(model.parameters(), lr=0.1)
    follow = Follower(tuple(model.parameters()), watched)
    assert follow.adopts(watched)
    assert follow.adopts(torch.optim.Adam(model.parameters()))
    assert not follow.adopts(torch.optim.Adam(other.parameters()))


def test_notices_are_due_again_once_connected_then_every_period() -> None:
    board = NoticeBoard(every_s=30.0)
    assert board.add(Notice("a", "why"), now=0.0, connected=False)
    assert not board.add(Notice("a", "again"), now=1.0, connected=False)
    assert board.due(2.0, connected=False) == []
    assert [n.reason for n in board.due(3.0, connected=True)] == ["again"]
    assert board.due(4.0, connected=True) == []
    assert len(board.due(34.0, connected=True)) == 1
