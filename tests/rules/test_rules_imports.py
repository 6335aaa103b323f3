"""Training logs users already have (HF trainer_state.json, Lightning metrics.csv), as if live."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwatch.collector.cli import replay_main
from gradwatch.rules.imports import HistoryError, read_history, trainer_records, with_gaps
from gradwatch.rules.replay import backtest, replay_records
from gradwatch.rules.step import Eval, Step


def trainer_state(rows: list[dict[str, object]], **extra: object) -> dict[str, object]:
    return {"global_step": 100, "max_steps": 100, "logging_steps": 10, "log_history": rows, **extra}


def overfitting_rows() -> list[dict[str, object]]:
    """Train loss falls steadily; eval once per "epoch" (5 evals) rising from the first."""
    rows: list[dict[str, object]] = []
    for k in range(1, 51):
        step = 10 * k
        rows.append(
            {
                "epoch": step / 100,
                "grad_norm": 1.0,
                "learning_rate": 1e-4,
                "loss": 1.0 / k,
                "step": step,
            }
        )
        if step % 100 == 0:
            rows.append(
                {
                    "epoch": step / 100,
                    "eval_loss": 0.3 * (1 + 0.15 * (step // 100)),
                    "eval_runtime": 1.0,
                    "eval_accuracy": 0.9,
                    "step": step,
                }
            )
    rows.append({"epoch": 5.0, "step": 500, "train_loss": 0.2, "train_runtime": 10.0})
    return rows


def test_trainer_state_rows_become_what_the_callback_sends(tmp_path: Path) -> None:
    path = tmp_path / "out" / "checkpoint-500" / "trainer_state.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(trainer_state(overfitting_rows())))
    run = read_history(path)
    assert run.job == "out" and run.format == "trainer_state" and run.max_steps == 100
    assert (run.steps, run.evals) == (50, 5)  # the train_loss summary row is not a step
    first = run.records[0]
    assert (
        isinstance(first, Step)
        and first.step == 10
        and first.loss == 1.0
        and first.grad_norm == 1.0
    )
    assert first.lr == (1e-4,) and first.grad_norm_logged
    ev = next(r for r in run.records if isinstance(r, Eval))
    assert (
        ev.step == 100
        and ev.loss == pytest.approx(0.345)
        and ev.metrics == {"runtime": 1.0, "accuracy": 0.9}
    )


def test_a_gzipped_log_replays_to_the_overfitting_alert(tmp_path: Path) -> None:
    path = tmp_path / "run7__trainer_state.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(trainer_state(overfitting_rows()), f)
    run, transitions = backtest(path)
    assert run.job == "run7__trainer_state"
    fired = [t.alert for t in transitions if t.current == "firing"]
    assert [(a.rule, a.category) for a in fired] == [("GeneralizationGap", "generalization_gap")]
    assert fired[0].step == 400  # evals 3 and 4 (0.435, 0.48) are 25% over the best (0.345)


def test_overflow_skips_are_designed_behaviour_and_a_real_nan_is_not(tmp_path: Path) -> None:
    rows = [
        {"step": s, "loss": 2.0 - 0.01 * s, "grad_norm": g, "learning_rate": 1e-4}
        for s, g in [(1, math.nan), (2, math.inf), (3, 1.5), (4, 1.4)]
    ]
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(trainer_state(rows)))  # json writes NaN/Infinity as the Trainer does
    steps = [r for r in read_history(path).records if isinstance(r, Step)]
    assert [s.skipped for s in steps] == [True, True, False, False]
    assert all(s.loss_scale is not None and math.isnan(s.loss_scale) for s in steps[:2])
    # Non-finite and the run did not carry on: kept as it is, for the non-finite rule.
    rows += [
        {"step": 5, "loss": 1.9, "grad_norm": math.nan, "learning_rate": 1e-4},
        {"step": 6, "loss": math.nan, "grad_norm": math.nan, "learning_rate": 1e-4},
    ]
    path.write_text(json.dumps(trainer_state(rows)))
    _, transitions = backtest(path)
    fired = [t.alert for t in transitions if t.current == "firing"]
    assert [(a.rule, a.step) for a in fired] == [("NonFiniteGradients", 5)]


def test_lightning_csv_merges_rows_of_one_step(tmp_path: Path) -> None:
    path = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    path.parent.mkdir(parents=True)
    lines = ["epoch,lr-AdamW,step,train_loss_step,train_loss_epoch,val_loss,grad_2.0_norm_total"]
    for s in range(40):
        lines.append(f",0.001,{s},,,,")  # LearningRateMonitor row
        lines.append(f"0,,{s},{2.0 - 0.01 * s},,,{1.0 + 0.01 * s}")
    lines.append("0,,39,,1.9,1.8,")  # end of epoch: the epoch mean and the validation loss
    path.write_text("\n".join(lines) + "\n")
    run = read_history(path)
    assert run.job == "version_0" and run.format == "lightning_csv"
    steps = [r for r in run.records if isinstance(r, Step)]
    assert len(steps) == 40 and steps[5].lr == (0.001,) and steps[5].loss == pytest.approx(1.95)
    assert steps[5].grad_norm == pytest.approx(1.05) and steps[5].grad_norm_logged
    assert (
        isinstance(run.records[-1], Eval)
        and run.records[-1].loss == 1.8
        and run.records[-1].step == 39
    )


def test_with_gaps_adds_the_unlogged_steps_empty() -> None:
    records = [Step(job="j", step=s, time=float(s), loss=1.0) for s in (10, 20)]
    filled = with_gaps(records)
    assert [r.step for r in filled] == list(range(10, 21))
    assert all(r.loss is None and r.grad_norm is None and r.lr == () for r in filled[1:-1])


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("trainer_state.json", "{", "not valid JSON"),
        ("trainer_state.json", "{}", "no 'log_history'"),
        ("metrics.csv", "epoch,loss\n1,2\n", "no 'step' column"),
        ("metrics.csv", "step,acc\n1,2\n", "no training loss column"),
        ("trainer_state.json.gz", "not gzip", "cannot read"),
        ("run.txt", "", "not a trainer_state"),
    ],
)
def test_bad_logs_say_what_is_wrong(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(HistoryError, match=message):
        read_history(path)


def test_the_replay_cli_reads_training_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(trainer_state(overfitting_rows())))
    assert replay_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "(trainer_state): 50 logged steps, 5 evals, 1 alert(s) fired" in out
        and "GeneralizationGap" in out
    )
    assert replay_main([str(path), "--json"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["transition"] == "firing" and line["alert"]["category"] == "generalization_gap"
    path.write_text("{}")
    assert replay_main([str(path)]) == 2
    assert "no 'log_history'" in capsys.readouterr().err


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
_ROWS = st.lists(
    st.dictionaries(
        st.sampled_from(
            ["step", "loss", "grad_norm", "learning_rate", "eval_loss", "eval_acc", "epoch"]
        ),
        _VALUES,
        max_size=6,
    ),
    max_size=30,
)


@given(rows=_ROWS)
@settings(max_examples=60)
def test_any_log_history_imports_and_replays_without_crashing(
    rows: list[dict[str, object]],
) -> None:
    # A hand-edited or truncated log must give records or a HistoryError, never a crash.
    records = trainer_records(rows, "j")
    assert all(isinstance(r, (Step, Eval)) for r in records)
    replay_records(records)


def test_a_step_beyond_the_wire_bound_is_skipped_not_a_crash() -> None:
    # Found by the property above: a row at step 9.25e18 (over int64) with a loss of -inf
    # crashed the non-finite rule's int64 bookkeeping (OverflowError).
    rows = [{"loss": -math.inf, "step": 9.253405579682589e18}, {"loss": 1.0, "step": -3}]
    rows.append({"loss": 2.0, "step": 4})
    records = trainer_records(rows, "j")
    assert [r.step for r in records] == [4]
    replay_records(records)


def test_with_gaps_does_not_fill_an_absurd_jump() -> None:
    records = [Step(job="j", step=s, time=0.0, loss=1.0) for s in (1, 10**15)]
    assert [r.step for r in with_gaps(records)] == [1, 10**15]
