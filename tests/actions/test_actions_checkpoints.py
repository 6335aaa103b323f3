"""Checkpoint bookkeeping: the rollback target is the last save BEFORE the onset."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradwatch.collector.checkpoints import CheckpointStore
from gradwatch.rules import load_rules_text
from gradwatch.rules.rulefile import RuleFileError
from gradwatch.wire import Event


def test_last_good_is_before_onset_not_newest() -> None:
    store = CheckpointStore(None)
    for step in (100, 200, 300, 400):
        store.add("run-1", step, f"ckpt/{step}.pt", time=float(step))
    # The incident began at 250; 300 and 400 were saved after it: poisoned.
    found = store.last_good("run-1", before_step=250)
    assert found is not None and (found.step, found.path) == (200, "ckpt/200.pt")
    # Strictly before: a checkpoint saved at the onset step already holds its update.
    # Checkpoints 100 and 200 were added above.
    assert store.last_good("run-1", before_step=300).step == 200  # type: ignore[union-attr]
    # Checkpoint 100 was added above.
    assert store.last_good("run-1", before_step=250, margin=100).step == 100  # type: ignore[union-attr]
    assert store.last_good("run-1", before_step=100) is None
    assert store.last_good("other", before_step=10_000) is None
    store.close()


def test_ranks_and_entries_are_immutable() -> None:
    store = CheckpointStore(None)
    assert store.add("run-1", 100, "rank1/100.pt", time=1.0, rank=1)
    assert store.add("run-1", 100, "rank0/100.pt", time=1.0, rank=0)
    # A second report of (job, step, rank) (a forged one, say) never replaces the first.
    assert not store.add("run-1", 100, "/tmp/attacker-controlled.pt", time=2.0, rank=0)
    found = store.last_good("run-1", 150)
    assert found is not None and found.path == "rank0/100.pt"  # rank 0 wins
    assert len(store.of("run-1")) == 2 and store.rows() == 2
    store.close()


def test_bounded_per_job_in_all_and_by_age() -> None:
    store = CheckpointStore(None, max_per_job=3, max_rows=10, max_age_s=100.0)
    for step in range(1, 6):
        store.add("run-1", step, f"{step}.pt", time=0.0, now=0.0)
    assert [c.step for c in store.of("run-1")] == [3, 4, 5]  # the newest steps per job
    for job in range(20):  # a job-name bomb: one save each
        store.add(f"bomb-{job}", 1, "x.pt", time=50.0, now=50.0)
    assert store.rows() <= 10
    # Past max_age_s (by the collector's clock) everything older is pruned at the next report.
    store.add("late", 1, "l.pt", time=500.0, now=500.0)
    assert store.rows() == 1 and store.of("run-1") == []
    store.close()


def test_checkpoints_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state" / "actions.sqlite3"
    store = CheckpointStore(path)
    store.add("run-1", 100, "ckpt/100.pt", time=1.0)
    store.close()
    again = CheckpointStore(path)
    # Checkpoint 100 was stored before reopening.
    assert again.last_good("run-1", 101).path == "ckpt/100.pt"  # type: ignore[union-attr]
    again.close()


def test_actions_take_checkpoint_events() -> None:
    from gradwatch.collector.actions import Actions, ActionSettings

    actions = Actions(ActionSettings(key=None), {}, send=None)
    actions.observe_event(
        Event(
            job="j",
            rank=0,
            incarnation="a",
            time=1.0,
            kind="checkpoint",
            step=10,
            fields={"path": "c/10.pt"},
        )
    )
    actions.observe_event(
        Event(
            job="j", rank=0, incarnation="a", time=1.0, kind="eval", step=20, fields={"loss": 1.0}
        )
    )
    actions.observe_event(
        Event(job="j", rank=0, incarnation="a", time=1.0, kind="checkpoint", step=30, fields={})
    )  # no path: nothing to roll back to
    assert [c.step for c in actions.checkpoints.of("j")] == [10]
    actions.close()


RULE = """
groups:
  - name: g
    rules:
      - alert: NaNLoss
        detector: nonfinite
        severity: critical
        category: numerical
        actions: [{actions}]
"""


def test_rule_files_accept_rollback_and_refuse_unknown_actions() -> None:
    (spec,) = load_rules_text(RULE.format(actions="notify, rollback"))
    assert spec.actions == ("notify", "rollback")
    with pytest.raises(RuleFileError, match=r"<string>:9: .*actions\[1\]"):
        load_rules_text(RULE.format(actions="notify, reboot"))
