"""Record -> replay gives the live alerts; the replay CLI; the recorder never hurts the collector.

The recorder and the CLI live in the collector; they are tested here, beside the
replay they exist for.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry

from gradwatch.collector.cli import collector_parser, replay_main
from gradwatch.collector.config import CollectorConfig, load_config
from gradwatch.collector.recorder import TraceRecorder, trace_file_name
from gradwatch.collector.server import Server
from gradwatch.rules import Engine, Transition, load_default_rules
from gradwatch.rules.replay import Replay, replay
from gradwatch.rules.step import Eval, Stats, Step
from gradwatch.rules.testing import Record, fault_run, worked_example
from gradwatch.wire import Batch, Event, Heartbeat, Schema, encode
from gradwatch.wire.trace import TraceError

RULES = load_default_rules()


def live_and_record(
    records: Iterable[Record], directory: Path, checkpoints: dict[int, str] | None = None
) -> tuple[list[Transition], Path]:
    """Run the engine live (clock = record time) while recording; return transitions and file."""
    now = [0.0]
    engine = Engine(RULES, clock=lambda: now[0])
    recorder = TraceRecorder(directory)
    out: list[Transition] = []
    job = ""
    for record in records:
        now[0], job = record.time, record.job
        out += engine.feed(record)
        if isinstance(record, Step):
            recorder.step(record)
            if checkpoints and record.step in checkpoints:
                recorder.event(
                    Event(
                        job,
                        0,
                        "inc",
                        record.time,
                        "checkpoint",
                        record.step,
                        {"path": checkpoints[record.step]},
                    )
                )
        elif isinstance(record, Stats):
            recorder.stats(record)
        else:
            assert isinstance(record, Eval)
            recorder.eval(record)
    recorder.close()
    assert recorder.enabled
    return out, directory / f"{trace_file_name(job)}.jsonl"


@pytest.mark.parametrize("run", ["worked_example", "spike", "overfit", "loss_scale", "saturation"])
def test_replay_of_a_recording_gives_the_live_alerts(run: str, tmp_path: Path) -> None:
    records = worked_example() if run == "worked_example" else fault_run(run, steps=1600).records()
    live, path = live_and_record(records, tmp_path)
    assert live, "the fault should have alerted live"
    replayed = replay(path, RULES)
    assert [t.alert.to_dict() for t in replayed] == [t.alert.to_dict() for t in live]
    assert [(t.previous, t.current) for t in replayed] == [(t.previous, t.current) for t in live]


def test_replay_takes_lines_and_skips_bad_ones_when_lenient(tmp_path: Path) -> None:
    _, path = live_and_record(worked_example(), tmp_path)
    lines = path.read_text().splitlines()
    lines.insert(3, '{"type":"step","step":"x"}')
    with pytest.raises(TraceError, match=r"<trace>:4: step: expected a whole number"):
        replay(lines, RULES)
    run = Replay(RULES, strict=False)
    assert [t.alert.rule for t in run.run(lines)][-1] == "NonFiniteGradients"
    assert run.skipped == 1 and run.problems[0][0] == 4


def test_on_record_sees_every_record_in_file_order_and_changes_nothing(tmp_path: Path) -> None:
    _, path = live_and_record(worked_example(), tmp_path)
    seen: list[Any] = []
    run = Replay(RULES)
    with_hook = run.run(path, on_record=seen.append)
    assert len(seen) == run.records > 0
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]  # after the header
    assert [type(r).__name__.removeprefix("Trace").lower() for r in seen] == [
        d["type"] for d in lines
    ]
    without = Replay(RULES).run(path)
    assert [t.alert.to_dict() for t in with_hook] == [t.alert.to_dict() for t in without]


def test_replay_ticks_liveness_from_the_trace() -> None:
    header = '{"type":"header","version":1,"job":"j","layers":[]}'
    lines = [header]
    for t in range(1, 50):
        lines.append(
            json.dumps({"type": "step", "step": t, "rank": 0, "time": float(t), "loss": 1.0})
        )
        lines.append(
            json.dumps({"type": "step", "step": t, "rank": 1, "time": float(t), "loss": 1.0})
        )
    for t in range(50, 200):  # rank 1 goes silent; rank 0 keeps stepping
        lines.append(
            json.dumps({"type": "step", "step": t, "rank": 0, "time": float(t), "loss": 1.0})
        )
    silent = [t for t in replay(lines, RULES) if t.alert.rule == "RankSilent"]
    assert [(t.current, t.alert.rank, t.alert.step) for t in silent] == [("firing", 1, 49)]
    assert (
        silent[0].alert.started_at == 110.0
    )  # 60 s after rank 1's last record, on the trace's clock


# ---------------------------------------------------------------- the CLI


def test_replay_cli_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, path = live_and_record(
        worked_example(), tmp_path, checkpoints={10: "ckpt/10.pt", 30: "ckpt/30.pt"}
    )
    assert replay_main([str(path), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["transition"], x["alert"]["rule"]) for x in lines] == [
        ("firing", "ActivationsSaturated"),
        ("firing", "LayerGradNormRatioVanishing"),
        ("firing", "NonFiniteGradients"),
    ]
    nan = lines[-1]["alert"]
    assert nan["evidence"]["loss"] == "nan" and nan["diagnosis"]["verdict"] == "numerical"
    assert nan["last_good_checkpoint"] == "ckpt/30.pt"  # saved before step 40, the newest such
    # Saturation began at or before step 10: no checkpoint predates it, so none is named.
    saturated, ratio = lines[0]["alert"], lines[1]["alert"]
    assert saturated["step"] <= 10 and saturated["last_good_checkpoint"] is None
    assert 10 < ratio["step"] <= 30 and ratio["last_good_checkpoint"] == "ckpt/10.pt"
    assert replay_main([str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "job seed-example: 49 records, 3 alert(s) fired"
    assert table[1].split() == ["STEP", "STATE", "SEVERITY", "RULE", "CATEGORY", "RANK", "SUMMARY"]
    assert table[-1].split()[:4] == ["40", "firing", "critical", "NonFiniteGradients"]


def test_replay_cli_failures_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type":"header","version":1,"job":"j","layers":[]}\n{"type":"step"}\n')
    assert replay_main([str(bad)]) == 0  # lenient by default: skipped and reported
    assert "skipped 1 bad line(s) (line 2: step: missing)" in capsys.readouterr().err
    assert replay_main([str(bad), "--strict"]) == 2
    assert "bad.jsonl:2: step: missing" in capsys.readouterr().err
    assert replay_main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    rules = tmp_path / "rules.yaml"
    rules.write_text("groups: []\nnope: 1\n")
    assert replay_main([str(bad), "--rules", str(rules)]) == 2
    assert "rule file" in capsys.readouterr().err


# ---------------------------------------------------------------- the recorder


def step(job: str, t: int) -> Step:
    return Step(
        job=job,
        step=t,
        time=float(t),
        loss=1.0,
        layers=("a", "b"),
        layer_norms=np.array([1.0, 2.0]),
    )


def test_write_failure_is_logged_once_and_switches_recording_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    recorder = TraceRecorder(blocker / "traces")
    with caplog.at_level(logging.ERROR, logger="gradwatch.collector.recorder"):
        for t in range(5):
            recorder.step(step("j", t))  # never raises
        recorder.heartbeat(Heartbeat("j", 0, 1, "inc", 1.0, 3, 0))
    assert not recorder.enabled
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "trace recording switched off" in errors[0].getMessage()
    recorder.close()


def test_file_names_restarts_and_many_jobs(tmp_path: Path) -> None:
    assert trace_file_name("run-42") == "run-42"
    weird = trace_file_name("../etc/passwd")
    assert (
        "/" not in weird and not weird.startswith(".") and weird != trace_file_name("_/etc/passwd")
    )
    (tmp_path / "a.jsonl").write_text("from an earlier collector\n")
    recorder = TraceRecorder(tmp_path, max_open=1)
    for t in range(1, 4):  # alternate jobs with one open file: each reopen appends
        recorder.step(step("a", t))
        recorder.step(step("b", t))
    recorder.eval(Eval(job="b", step=3, time=3.0, loss=0.5))
    recorder.close()
    assert (tmp_path / "a.jsonl").read_text() == "from an earlier collector\n"
    for name in ("a.1.jsonl", "b.jsonl"):
        run = Replay(RULES)
        run.run(tmp_path / name)
        assert run.records == (3 if name.startswith("a") else 4) and run.header is not None


def test_collector_records_what_it_receives(tmp_path: Path) -> None:
    config = CollectorConfig(
        listen="tcp://127.0.0.1:*", metrics_addr="127.0.0.1:0", record_dir=tmp_path
    )
    server = Server(config, registry=CollectorRegistry())
    server.start()
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.setsockopt(zmq.LINGER, 0)
        push.connect(server.bound_endpoint)
        schema = Schema(1, ("loss", "lr/0"), ("embed.weight", "fc.weight"))
        rows = np.array([[2.0, 0.1, 1.0, 0.5], [1.5, 0.1, float("nan"), 0.5]], "<f4")
        push.send_multipart(
            encode(Batch("run-1", 0, 1, 1, 0, "inc", 0, (1, 2), (0.5, 1.0), rows.tobytes(), schema))
        )
        push.send_multipart(encode(Heartbeat("run-1", 0, 1, "inc", 1.5, 2, 0)))
        push.send_multipart(
            encode(Event("run-1", 0, "inc", 1.6, "eval", 2, {"loss": 2.5, "acc": 0.5}))
        )
        assert server.wait_for_messages(3, timeout=10)
    finally:
        push.close(linger=0)
        ctx.term()
        assert server.stop(10)
    text = (tmp_path / "run-1.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in text] == [
        "header",
        "step",
        "step",
        "heartbeat",
        "eval",
    ]
    assert json.loads(text[2])["layer_grad_norms"] == ["nan", 0.5]
    assert json.loads(text[4])["metrics"] == {"acc": 0.5}
    assert [(t.alert.rule, t.alert.step) for t in replay(tmp_path / "run-1.jsonl", RULES)] == [
        ("NonFiniteGradients", 2)
    ]


def test_records_before_the_first_step_wait_for_its_layers(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path)
    recorder.heartbeat(Heartbeat("j", 0, 1, "inc", 0.5, 0, 0))
    recorder.event(Event("j", 0, "inc", 0.6, "note", 0, {"text": "hello"}))
    recorder.step(step("j", 1))
    recorder.heartbeat(Heartbeat("idle", 0, 1, "inc", 0.5, 0, 0))  # never steps
    recorder.close()
    lines = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert [x["type"] for x in lines] == ["header", "heartbeat", "event", "step"]
    assert lines[0]["layers"] == ["a", "b"] and "layers" not in lines[3]
    idle = [json.loads(line) for line in (tmp_path / "idle.jsonl").read_text().splitlines()]
    assert [x["type"] for x in idle] == ["header", "heartbeat"] and idle[0]["layers"] == []


def test_collector_flag_sets_the_record_dir(tmp_path: Path) -> None:
    args = collector_parser().parse_args(["--record", str(tmp_path)])
    assert load_config(None, {"record_dir": args.record_dir}).record_dir == tmp_path
