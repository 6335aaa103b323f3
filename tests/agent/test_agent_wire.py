"""What the agent puts on the wire, decoded from a real PULL socket on loopback."""

from __future__ import annotations

import struct
import time

import pytest
import torch
import zmq
from torch import nn

import gradwatch
from gradwatch.agent.monitor import Monitor
from gradwatch.wire import MISSING_BITS, Batch, Event, Heartbeat, Message, Schema, decode
from gradwatch.wire import columns as wc
from tests.agent.receiver import batch_config, drain, rebind

WAIT_MS = 5000


class Net(nn.Module):
    """Two used layers, one that never gets a gradient, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        self.unused = nn.Linear(2, 2)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.fc2(torch.relu(self.fc1(x))))


def recv(sock: zmq.Socket) -> Message:
    assert sock.poll(WAIT_MS), "nothing arrived from the agent in time"
    return decode(sock.recv_multipart())


def wait_connected(sock: zmq.Socket) -> None:
    """A heartbeat arriving proves the agent's PUSH socket is connected."""
    assert isinstance(recv(sock), Heartbeat)


def collect(sock: zmq.Socket, n_steps: int, n_events: int = 0) -> tuple[list[Batch], list[Event]]:
    batches: list[Batch] = []
    events: list[Event] = []
    while sum(len(b.steps) for b in batches) < n_steps or len(events) < n_events:
        msg = recv(sock)
        if isinstance(msg, Batch) and msg.schema_id != wc.STATS_SCHEMA_ID:  # steps only
            batches.append(msg)
        elif isinstance(msg, Event):
            events.append(msg)
    return batches, events


def rows(batches: list[Batch]) -> dict[int, tuple[dict[str, tuple[float, int]], list[float]]]:
    """step -> ({column: (value, bits)}, layer values), resolving schema by id."""
    schemas: dict[int, Schema] = {}
    out = {}
    for batch in batches:
        if batch.schema is not None:
            schemas[batch.schema.id] = batch.schema
        schema = schemas[batch.schema_id]
        n = len(batch.values) // 4
        floats = struct.unpack(f"<{n}f", batch.values)
        bits = struct.unpack(f"<{n}I", batch.values)
        for r, step in enumerate(batch.steps):
            base = r * schema.width
            cols = {c: (floats[base + i], bits[base + i]) for i, c in enumerate(schema.columns)}
            layers = list(floats[base + len(schema.columns) : base + schema.width])
            out[step] = (cols, layers)
    return out


def test_batches_match_directly_computed_norms_and_scalars(pull):
    sock, endpoint = pull
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, batch_config("wire", endpoint))
    wait_connected(sock)
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    expected: dict[int, tuple[list[float], float, float]] = {}
    n_steps, change_at = 25, 12
    for i in range(n_steps):
        loss = model(torch.randn(5, 6)).pow(2).mean() * 10
        loss.backward()
        pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norms = [
            0.0 if p.grad is None else torch.linalg.vector_norm(p.grad).item() for p in trainable
        ]
        expected[mon.step + 1] = (norms, loss.item(), pre_clip.item())
        opt.step()
        step = i + 1  # what the agent numbers this step
        extra = {"extra": float(step)} if step >= change_at and step % 2 == 0 else {}
        mon.log(loss=loss, grad_norm=pre_clip, **extra)
        opt.zero_grad()
    mon.log_eval(loss=torch.tensor(2.5), acc=0.75)
    mon.checkpoint_saved(24, "ckpt/24.pt")
    mon.close()
    batches, events = collect(sock, n_steps, n_events=2)

    table = rows(batches)
    assert sorted(table) == list(range(1, n_steps + 1))
    first = batches[0].schema
    assert first is not None
    assert first.layers == (
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
        "unused.weight",
        "unused.bias",
    )
    assert {"loss", "lr/0", "skipped", "s/grad_norm"} <= set(first.columns)
    for step, (cols, layers) in table.items():
        norms, loss, pre_clip = expected[step]
        assert layers == pytest.approx(norms, rel=1e-5, abs=1e-7)
        assert layers[-2:] == [0.0, 0.0]  # no gradient this step is 0, not missing
        assert cols["loss"][0] == pytest.approx(loss, rel=1e-6)
        assert cols["s/grad_norm"][0] == pytest.approx(pre_clip, rel=1e-6)
        assert cols["lr/0"][0] == pytest.approx(0.1)
        assert cols["skipped"][0] == 0.0
        if step >= change_at:
            value, bits = cols["s/extra"]
            if step % 2 == 0:
                assert value == float(step)
            else:
                assert bits == MISSING_BITS
        else:
            assert "s/extra" not in cols

    # The schema travels when it is new, not with every batch.
    ids = [b.schema_id for b in batches]
    carried = [b.schema is not None for b in batches]
    changed = [True] + [a != b for a, b in zip(ids, ids[1:], strict=False)]
    assert carried == changed
    assert len(set(ids)) == 2 and ids[-1] > ids[0]
    assert all(b.dropped == 0 for b in batches)
    assert [b.seq for b in batches] == list(range(len(batches)))

    by_kind = {e.kind: e for e in events}
    assert by_kind["eval"].fields == {"loss": 2.5, "acc": 0.75}
    assert by_kind["eval"].step == n_steps
    assert by_kind["checkpoint"].fields == {"path": "ckpt/24.pt"}
    assert by_kind["checkpoint"].step == 24
    assert mon.stats.steps_sent == n_steps


def test_norms_read_on_cpu_and_stacked_by_the_shipper_arrive_exact(pull):
    # On CPU the pre-hook keeps the fused read's norms and the shipper writes them into
    # their rows (agent/layout.py: fill_norms). A step where a layer has no gradient
    # takes the stacked path, so a batch mixes both; a new column mid-batch flushes early.
    sock, endpoint = pull
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    head = nn.Linear(3, 2)  # gets a gradient on some steps only
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    both = nn.Sequential(model, head)
    mon = Monitor(both, opt, batch_config("deferred", endpoint))
    wait_connected(sock)
    n_steps = 14
    expected: dict[int, list[float]] = {}
    deferred: list[bool] = []
    for step in range(1, n_steps + 1):
        out = model(torch.randn(5, 6))
        with_head = step % 3 != 0
        loss = (head(out) if with_head else out).pow(2).mean()
        loss.backward()
        expected[step] = [
            0.0 if p.grad is None else torch.linalg.vector_norm(p.grad).item()
            for p in both.parameters()
        ]
        opt.step()
        deferred.append(mon._norms is not None)
        mon.log(loss=loss, **({"late": 1.0} if step >= 6 else {}))
        opt.zero_grad(set_to_none=True)
    mon.close()
    assert deferred == [step % 3 != 0 for step in range(1, n_steps + 1)]
    table = rows(collect(sock, n_steps)[0])
    assert sorted(table) == list(range(1, n_steps + 1))
    for step, (_, layers) in table.items():
        assert layers == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step


def test_unmeasured_cells_are_missing_not_zero(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(
        model, opt, job="missing", endpoint=endpoint, flush_every=3, heartbeat_every=0.05
    )
    wait_connected(sock)
    for i in range(3):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        if i == 1:
            mon.log()  # a step without a loss
        else:
            mon.log(loss=torch.tensor(1.0))
        opt.zero_grad()
    mon.close()
    table = rows(collect(sock, 3)[0])
    assert table[2][0]["loss"][1] == MISSING_BITS
    assert table[1][0]["loss"][0] == 1.0
    assert "loss_scale" not in table[1][0]  # no scaler, no column


def test_two_optimizer_steps_without_log_still_make_two_rows(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(
        model, opt, job="twice", endpoint=endpoint, flush_every=8, heartbeat_every=0.05
    )
    wait_connected(sock)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    opt.step()  # no log() in between: the first step is committed anyway
    mon.log(loss=3.0)
    mon.close()
    table = rows(collect(sock, 2)[0])
    assert table[1][0]["loss"][1] == MISSING_BITS
    assert table[2][0]["loss"][0] == 3.0
    assert table[1][0]["skipped"][0] == table[2][0]["skipped"][0] == 0.0


def test_heartbeats_carry_the_last_logged_step(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, job="hb", endpoint=endpoint, heartbeat_every=0.02) as mon:
        first = recv(sock)
        assert isinstance(first, Heartbeat) and first.step == 0  # nothing logged yet
        for _ in range(5):
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            mon.log(loss=1.0)
        for _ in range(200):  # bounded: heartbeats arrive every 20 ms
            msg = recv(sock)
            if isinstance(msg, Heartbeat) and msg.step == 5:
                break
        else:
            pytest.fail("no heartbeat reported step 5")
        assert msg.incarnation == mon.incarnation and msg.job == "hb"


def test_lr_tensor_and_cpu_tensor_scalars_are_recorded(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05))
    mon = gradwatch.watch(
        model, opt, job="lr", endpoint=endpoint, flush_every=2, heartbeat_every=0.05
    )
    wait_connected(sock)
    for _ in range(2):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        mon.log(loss=torch.tensor([1.5]), tokens=128, bad=torch.ones(3))
    mon.close()
    table = rows(collect(sock, 2)[0])
    cols = table[2][0]
    assert cols["lr/0"][0] == pytest.approx(0.05)
    assert cols["loss"][0] == 1.5
    assert cols["s/tokens"][0] == 128.0
    assert "s/bad" not in cols  # a multi-element tensor is skipped with a warning


def test_lr_is_the_one_the_step_used_even_if_the_scheduler_steps_before_log(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    mon = gradwatch.watch(
        model, opt, job="lr", endpoint=endpoint, flush_every=3, heartbeat_every=0.05
    )
    wait_connected(sock)
    for _ in range(3):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        sched.step()  # before log(), as many loops and trainers do
        mon.log(loss=1.0)
        opt.zero_grad()
    mon.close()
    table = rows(collect(sock, 3)[0])
    assert [table[s][0]["lr/0"][0] for s in (1, 2, 3)] == [1.0, 0.5, 0.25]


def test_eval_fields_that_json_cannot_carry_arrive_as_strings(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(model, opt, job="ev", endpoint=endpoint, heartbeat_every=0.05)
    wait_connected(sock)
    mon.log_eval(loss=torch.tensor(float("nan")), ppl=float("inf"), split="val", n=3)
    mon.close()
    (event,) = collect(sock, 0, n_events=1)[1]
    assert event.kind == "eval" and event.step == 0
    assert event.fields == {"loss": "nan", "ppl": "inf", "split": "val", "n": 3}


def test_schema_is_resent_after_the_collector_restarts():
    ctx = zmq.Context()
    first = ctx.socket(zmq.PULL)
    first.linger = 0
    port = first.bind_to_random_port("tcp://127.0.0.1")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(
        model,
        opt,
        job="restart",
        endpoint=f"tcp://127.0.0.1:{port}",
        flush_every=2,
        heartbeat_every=0.02,
    )

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            mon.log(loss=1.0)
            opt.zero_grad()

    second = None
    try:
        wait_connected(first)
        steps(4)
        before, _ = collect(first, 4)
        assert [b.schema is not None for b in before] == [True, False]
        first.close(linger=0)  # the collector goes away and comes back on the same port
        second = ctx.socket(zmq.PULL)
        second.linger = 0
        rebind(second, f"tcp://127.0.0.1:{port}")
        wait_connected(second)
        steps(2)
        (after,), _ = collect(second, 2)
        assert after.schema is not None and after.schema_id == before[0].schema_id
    finally:
        mon.close()
        if second is not None:
            second.close(linger=0)
        first.close(linger=0)
        ctx.term()


def test_step_phases_measure_data_wait_and_forward_and_heartbeats_say_started(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(
        model,
        opt,
        job="phases",
        endpoint=endpoint,
        flush_every=3,
        heartbeat_every=0.02,
        phase_clock=True,  # one process: off unless asked for
    ) as mon:
        for _ in range(3):
            time.sleep(0.05)  # the data loader: the host waits before the forward
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            mon.log(loss=1.0)
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 6))  # an eval forward between steps is not a step
        model.train()
        model(torch.randn(2, 6)).sum().backward()  # step 4 has begun: it waits in "backward"
        seen: list[Message] = []
        for _ in range(200):  # bounded: heartbeats arrive every 20 ms
            seen.append(recv(sock))
            if isinstance(seen[-1], Heartbeat) and seen[-1].step == 3 and seen[-1].started == 4:
                break
        else:
            pytest.fail("no heartbeat said step 4 had started")
        opt.step()
        mon.log(loss=1.0)
    got = rows(
        [
            b
            for b in seen + drain(sock)
            if isinstance(b, Batch) and b.schema_id != wc.STATS_SCHEMA_ID
        ]
    )
    for step in (1, 2, 3):
        cols, _ = got[step]
        assert cols["s/data_seconds"][0] >= 0.045  # the 50 ms wait, measured on the host
        assert 0.0 < cols["s/forward_seconds"][0] < 0.045
    assert got[4][0]["s/data_seconds"][0] < 0.045  # no wait before step 4's forward


def test_the_phase_clock_is_on_where_a_rule_reads_it(pull):
    # Its timings serve the rules that compare ranks (a straggler, the rank a hung job
    # waits for); in one process its two hooks are a cost without a reader.
    sock, endpoint = pull

    def clock(**kwargs: object) -> tuple[int, int]:
        model = Net()
        opt = kwargs.pop("opt", torch.optim.SGD(model.parameters(), lr=0.1))
        mon = gradwatch.watch(model, opt, job="clock", endpoint=endpoint, **kwargs)
        hooks = len(model._forward_pre_hooks), len(model._forward_hooks)
        mon.close()
        return hooks

    assert clock() == (0, 0)  # one process
    assert clock(rank=1, world=2) == (1, 1)
    assert clock(opt=None) == (1, 1)  # no optimizer: its first forward reads the weights
    assert clock(phase_clock=True) == (1, 1)
    assert clock(rank=0, world=2, phase_clock=False) == (0, 0)
    drain(sock)


def test_one_process_sends_no_phases_and_no_started(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(
        model, opt, job="noclock", endpoint=endpoint, flush_every=2, heartbeat_every=0.02
    ) as mon:
        seen = [recv(sock)]  # a heartbeat: connected, so the batch is not dropped
        for _ in range(2):
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            mon.log(loss=1.0)
    seen += drain(sock)
    got = rows([b for b in seen if isinstance(b, Batch) and b.schema_id != wc.STATS_SCHEMA_ID])
    assert sorted(got) == [1, 2]
    assert not any(name.startswith(("s/data_seconds", "s/forward_seconds")) for name in got[1][0])
    beats = [m for m in seen if isinstance(m, Heartbeat)]
    assert beats and all(b.started is None for b in beats)


def test_a_forward_without_autograd_in_train_mode_is_not_the_steps_forward(pull):
    # An evaluation that leaves the model in train mode (pytorch/examples'
    # time_sequence_prediction) ran between steps: it is not the step's forward pass.
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(
        model, opt, job="nograd", endpoint=endpoint, flush_every=2, phase_clock=True
    ) as mon:
        slow = model.register_forward_pre_hook(lambda m, a: time.sleep(0.05))  # after ours
        with torch.no_grad():
            model(torch.randn(2, 6))  # 50 ms without autograd, in train mode
        slow.remove()
        for _ in range(2):
            model(torch.randn(2, 6)).sum().backward()
            opt.step()
            mon.log(loss=1.0)
    got = rows(
        [b for b in drain(sock) if isinstance(b, Batch) and b.schema_id != wc.STATS_SCHEMA_ID]
    )
    assert got[1][0]["s/forward_seconds"][0] < 0.045  # the evaluation is not in it
    assert got[1][0]["s/data_seconds"][0] >= 0.045  # it came before the step's forward


def test_close_says_so_after_the_last_batch(pull):
    sock, endpoint = pull
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gradwatch.watch(model, opt, job="bye", endpoint=endpoint, flush_every=100)
    wait_connected(sock)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    mon.log(loss=1.0)
    mon.close()
    sent = [m for m in drain(sock) if not isinstance(m, Heartbeat)]
    assert isinstance(sent[0], Batch) and sent[0].steps == (1,)
    assert isinstance(sent[-1], Event) and (sent[-1].kind, sent[-1].fields) == (
        "note",
        {"note": "closed"},
    )
