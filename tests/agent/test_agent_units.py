"""The agent's parts on their own: gradient reader, column layout, buffer growth."""

from __future__ import annotations

import struct

import pytest
import torch
import zmq
from torch import nn

from gradwatch.agent import AgentConfig, Monitor
from gradwatch.agent.gradients import GradReader
from gradwatch.agent.layout import Columns, merge_rows
from gradwatch.wire import MISSING_BITS, Batch, Heartbeat, decode
from gradwatch.wire import columns as wc


def test_reader_maps_trainable_optimized_params_in_model_order():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD([model[2].weight, model[0].weight, model[0].bias], lr=0.1)
    reader = GradReader.attach(model, opt)
    assert reader.names == ("0.weight", "0.bias", "2.weight")  # 2.bias: not optimised


def test_reader_norms_all_dtypes_in_fp32_and_zero_for_absent_grads():
    params = {
        "f32": nn.Parameter(torch.randn(7)),
        "bf16": nn.Parameter(torch.randn(5, 3).bfloat16()),
        "f16": nn.Parameter(torch.randn(4).half()),
        "f64": nn.Parameter(torch.randn(6).double()),
        "nograd": nn.Parameter(torch.randn(2)),
    }
    model = nn.ParameterDict(params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, p in params.items():
        if name != "nograd":
            p.grad = torch.randn_like(p) * 1e3
    reader = GradReader.attach(model, opt)
    row = torch.full((len(params) + 2,), -1.0)
    reader.read_into(row[: len(params)])
    expected = [
        0.0 if p.grad is None else torch.linalg.vector_norm(p.grad.double()).item()
        for p in model.parameters()
    ]
    assert row[: len(params)].tolist() == pytest.approx(expected, rel=1e-3)
    assert row[-2:].tolist() == [-1.0, -1.0]  # nothing written past the layers
    assert row.dtype == torch.float32


def test_non_finite_gradients_give_non_finite_norms():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.zeros(2, 3)
    model.weight.grad[1, 1] = float("nan")
    model.bias.grad = torch.tensor([float("inf"), 1.0])
    row = torch.empty(2)
    GradReader.attach(model, opt).read_into(row)
    assert row[0].isnan() and row[1].isinf()


def test_merge_puts_host_and_device_values_in_schema_order():
    cols = Columns(layers=("a", "b"), base=("loss", "lr/0"), device_capacity=2)
    loss = cols.device_slot("loss")
    lr_dev = cols.device_slot("lr/0")
    lr_host = cols.host_slot("lr/0")  # the lr was a float on one step, a tensor on another
    extra = cols.host_slot("s/x")
    layout = cols.snapshot()
    assert layout.schema.columns == ("loss", "lr/0", "s/x")
    missing = struct.unpack("<f", struct.pack("<I", MISSING_BITS))[0]
    dev = torch.tensor([[1.0, 2.0, 0.5, missing], [3.0, 4.0, missing, 0.2]])
    assert (loss, lr_dev) == (2, 3)
    host = [[0.1, None], [None, 7]]
    raw = merge_rows(layout, dev, host)
    bits = struct.unpack("<10I", raw)
    values = struct.unpack("<10f", raw)
    assert values[0:2] == pytest.approx((0.5, 0.1))
    assert bits[2] == MISSING_BITS
    assert values[3:5] == (1.0, 2.0)
    assert bits[5] == MISSING_BITS
    assert values[6:8] == pytest.approx((0.2, 7.0))
    assert values[8:] == (3.0, 4.0)
    assert extra == 1 and lr_host == 0


def test_schema_id_grows_only_with_new_columns():
    cols = Columns(layers=("w",), base=("loss",), device_capacity=1)
    first = cols.snapshot().schema.id
    cols.device_slot("loss")
    cols.host_slot("loss")
    assert cols.snapshot().schema.id == first
    cols.host_slot("s/new")
    assert cols.snapshot().schema.id == first + 1
    cols.device_slot("s/a")
    cols.device_slot("s/b")
    assert cols.device_capacity == 4  # doubled as slots ran out


def test_device_row_growth_keeps_the_open_row():
    """More tensor scalars than preallocated slots: the buffer regrows mid-run."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = AgentConfig(
            job="grow",
            rank=0,
            world=1,
            endpoint=f"tcp://127.0.0.1:{port}",
            flush_every=4,
            heartbeat_every=0.05,
            device_columns=1,
        )
        mon = Monitor(model, opt, config)
        assert sock.poll(5000) and isinstance(decode(sock.recv_multipart()), Heartbeat)
        for i in range(6):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            names = {f"t{k}": torch.tensor(float(10 * i + k)) for k in range(min(i + 1, 4))}
            mon.log(loss=torch.tensor(float(i)), **names)
            opt.zero_grad()
        mon.close()
        seen: dict[int, dict[str, float]] = {}
        schemas = {}
        while len(seen) < 6:
            assert sock.poll(5000)
            msg = decode(sock.recv_multipart())
            if not isinstance(msg, Batch) or msg.schema_id == wc.STATS_SCHEMA_ID:  # steps only
                continue
            if msg.schema is not None:
                schemas[msg.schema.id] = msg.schema
            schema = schemas[msg.schema_id]
            vals = struct.unpack(f"<{len(msg.values) // 4}f", msg.values)
            for r, step in enumerate(msg.steps):
                seen[step] = dict(zip(schema.columns, vals[r * schema.width :], strict=False))
                layer = vals[r * schema.width + len(schema.columns)]
                assert layer == pytest.approx(
                    torch.linalg.vector_norm(torch.full((3,), 2.0)).item()
                )
        for i in range(6):
            assert seen[i + 1]["loss"] == float(i)
            for k in range(min(i + 1, 4)):
                assert seen[i + 1][f"s/t{k}"] == float(10 * i + k)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_compiled_model_is_watched_through_the_optimizer():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    config = AgentConfig(job="compiled", rank=0, world=1, endpoint="tcp://127.0.0.1:1")
    with Monitor(compiled, opt, config) as mon:
        assert mon._reader.names == ("0.weight", "0.bias", "2.weight", "2.bias")
        for _ in range(3):
            loss = compiled(torch.randn(5, 4)).pow(2).mean()
            loss.backward()
            row = mon._buffer.current
            opt.step()
            mon._settle_norms()  # on CPU the shipper writes them into the row
            expected = [torch.linalg.vector_norm(p.grad).item() for p in model.parameters()]
            assert row[:4].tolist() == pytest.approx(expected, rel=1e-5)
            mon.log(loss=loss)
            opt.zero_grad()
        assert mon.stats.steps_logged == 3 and mon.stats.disabled is None


def test_sharded_params_report_the_local_shard_norm():
    """FSDP2-style DTensor params: each rank sends its shard's norm, no collective."""
    dist = pytest.importorskip("torch.distributed")
    tensor_api = pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Parameter(
            tensor_api.distribute_tensor(torch.randn(4, 3), mesh, [tensor_api.Shard(0)])
        )
        plain = nn.Parameter(torch.randn(5))
        model = nn.ParameterDict({"sharded": sharded, "plain": plain})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sharded.grad = tensor_api.distribute_tensor(torch.randn(4, 3), mesh, [tensor_api.Shard(0)])
        plain.grad = torch.randn(5)
        reader = GradReader.attach(model, opt)
        assert reader.sharded
        row = torch.empty(2)
        reader.read_into(row)
        local = {"sharded": sharded.grad.to_local(), "plain": plain.grad}
        expected = [torch.linalg.vector_norm(local[name]).item() for name in reader.names]
        assert row.tolist() == pytest.approx(expected, rel=1e-6)
    finally:
        dist.destroy_process_group()
