"""``log_eval`` names the BatchNorm/Dropout modules left in training mode, as the
collector reads them."""

from __future__ import annotations

import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent.monitor import MAX_TRAIN_MODE_NAMES
from gradwatch.collector.ingest import eval_of
from gradwatch.wire import Event, Heartbeat, Message, decode

WAIT_MS = 5000


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.LayerNorm(8), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.fc(x)))


def recv(sock: zmq.Socket) -> Message:
    assert sock.poll(WAIT_MS), "nothing arrived from the agent in time"
    return decode(sock.recv_multipart())


def events(sock: zmq.Socket, count: int) -> list[Event]:
    got: list[Event] = []
    while len(got) < count:
        msg = recv(sock)
        if isinstance(msg, Event) and msg.kind == "eval":  # not a closed agent's "closed" note
            got.append(msg)
    return got


def watched(model: nn.Module, endpoint: str, sock: zmq.Socket) -> gradwatch.Monitor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(model, opt, job="ev", endpoint=endpoint, heartbeat_every=0.05)
    for _ in range(100):  # bounded; skips what an earlier monitor sent last ("closed")
        msg = recv(sock)
        if isinstance(msg, Heartbeat) and msg.incarnation == mon.incarnation:
            return mon  # connected: nothing sent later is lost
    raise AssertionError("the monitor's first heartbeat never arrived")


def test_log_eval_names_modules_left_in_training_mode(pull) -> None:
    sock, endpoint = pull
    model = Net()
    mon = watched(model, endpoint, sock)
    model.train()
    mon.log_eval(loss=1.0)
    model.eval()
    mon.log_eval(loss=torch.tensor(float("nan")))
    model.head[0].train()
    mon.log_eval(loss=0.5)
    mon.close()
    wrong, right, one = events(sock, 3)
    assert wrong.fields["train_mode_modules"] == ["bn", "head.0"]
    assert right.fields == {"loss": "nan", "train_mode_modules": []}
    ev = eval_of(one)
    assert ev.train_mode_modules == ("head.0",) and ev.loss == 0.5


def test_the_names_are_capped_and_a_model_without_such_modules_sends_none(pull) -> None:
    sock, endpoint = pull
    model = nn.Sequential(nn.Linear(2, 2), *(nn.Dropout() for _ in range(MAX_TRAIN_MODE_NAMES + 8)))
    mon = watched(model, endpoint, sock)
    mon.log_eval(loss=1.0)
    mon.close()
    (event,) = events(sock, 1)
    assert event.fields["train_mode_modules"] == [
        str(i) for i in range(1, MAX_TRAIN_MODE_NAMES + 1)
    ]

    plain = nn.Linear(2, 1)
    mon = watched(plain, endpoint, sock)
    mon.log_eval(loss=1.0)
    mon.close()
    (event,) = events(sock, 1)
    assert event.fields == {"loss": 1.0}
