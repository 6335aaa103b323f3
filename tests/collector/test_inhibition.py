"""One page per cause: the rules' ``inhibits`` on direct sinks, and in the shipped configs."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from gradwatch.collector.inhibition import Inhibition, InhibitionMetrics
from gradwatch.collector.pipeline import Pipeline
from gradwatch.rules import Alert, load_default_rules
from gradwatch.rules.alert import Transition
from gradwatch.rules.rulefile import RuleFileError, load_rules_text
from tests.recording_sink import RecordingSink

ROOT = Path(__file__).resolve().parents[2]
SOURCE, TARGET = "WeightsInflatingLossStalled", "WeightNormRunaway"


def alert(rule: str, job: str = "run-1", rank: int | None = None, state: str = "firing") -> Alert:
    return Alert(
        rule=rule,
        category="lr_too_high" if rule == SOURCE else "weight_runaway",
        severity="warning",
        job=job,
        state=state,  # type: ignore[arg-type]  # "firing" or "resolved", as the callers pass
        step=121,
        summary="s",
        started_at=0.0,
        rank=rank,
        id=f"{rule}:{job}:{rank}",
    )


def fire(a: Alert) -> Transition:
    return Transition(a, "pending", "firing")


def resolve(a: Alert) -> Transition:
    return Transition(replace(a, state="resolved", resolved_at=1.0), "firing", "resolved")


def default_inhibition() -> Inhibition:
    return Inhibition(load_default_rules())


def test_the_rule_pack_pairs_each_symptom_with_the_alert_that_explains_it() -> None:
    assert default_inhibition().pairs == {
        (SOURCE, TARGET),
        ("GradientsAllZero", "WeightsFrozen"),
        ("WeightGradientsCutOff", "WeightsFrozen"),
        ("WeightGradientsCutOff", "LayersFrozen"),
        ("DeadReLUs", "WeightGradientsCutOff"),
        ("DeadGELUSiLUUnits", "WeightGradientsCutOff"),
    }


def test_a_source_in_the_same_batch_mutes_the_target_whatever_the_order() -> None:
    inhibition = default_inhibition()
    batch = inhibition.order([fire(alert(TARGET)), fire(alert(SOURCE))])
    assert [t.alert.rule for t in batch] == [SOURCE, TARGET]
    assert [inhibition.muted(t) for t in batch] == [False, True]
    assert inhibition.counts == {TARGET: 1}
    # Its resolve is muted too (a pager never gets a lone "resolved"); a resolve whose
    # firing paged is not.
    assert inhibition.muted(resolve(alert(TARGET)))
    assert not inhibition.muted(resolve(alert(TARGET, rank=3)))


def test_only_the_same_job_and_only_while_the_source_fires() -> None:
    inhibition = default_inhibition()
    assert not inhibition.muted(fire(alert(TARGET)))  # no source yet: it pages
    assert not inhibition.muted(fire(alert(SOURCE, job="other")))
    assert not inhibition.muted(fire(alert(TARGET, job="run-2")))  # another job's source
    assert not inhibition.muted(fire(alert(SOURCE)))
    assert inhibition.muted(fire(alert(TARGET, rank=1)))
    # Two ranks fire the source; the target pages again only when both resolved.
    assert not inhibition.muted(fire(alert(SOURCE, rank=2)))
    assert not inhibition.muted(resolve(alert(SOURCE)))
    assert inhibition.muted(fire(alert(TARGET, rank=4)))
    assert not inhibition.muted(resolve(alert(SOURCE, rank=2)))
    assert not inhibition.muted(fire(alert(TARGET, rank=5)))
    # The source itself, and rules outside any pair, always page.
    assert not inhibition.muted(fire(alert("NonFiniteGradients")))


def test_a_pack_without_inhibits_mutes_nothing() -> None:
    inhibition = Inhibition(())
    assert inhibition.order([fire(alert(TARGET)), fire(alert(SOURCE))])[0].alert.rule == TARGET
    assert not inhibition.muted(fire(alert(SOURCE)))
    assert not inhibition.muted(fire(alert(TARGET)))


class _AlertmanagerLike(RecordingSink):
    name = "alertmanager-like"
    gets_muted = True  # as collector/alertmanager.py: AlertmanagerSink


def test_dispatch_skips_direct_sinks_and_counts_but_records_and_tells_alertmanager() -> None:
    direct, manager = RecordingSink(), _AlertmanagerLike()
    recorded: list[Any] = []
    pipeline = Pipeline.__new__(Pipeline)  # only what dispatch uses
    pipeline.actions = None
    pipeline.sinks = [direct, manager]
    pipeline.state = type("State", (), {"record_transition": staticmethod(recorded.append)})()
    pipeline.inhibition = default_inhibition()
    pipeline.dispatch([fire(alert(TARGET)), fire(alert(SOURCE))])
    pipeline.dispatch([resolve(alert(TARGET))])
    assert [(t.alert.rule, t.current) for t in direct.transitions] == [(SOURCE, "firing")]
    assert len(manager.transitions) == 3
    assert len(recorded) == 3
    family = next(iter(InhibitionMetrics(pipeline.inhibition).collect()))
    assert [(s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ({"rule": TARGET}, 2.0)
    ]


def _pack(inhibits: list[str]) -> str:
    rule = {"detector": "nonfinite", "severity": "critical", "category": "numerical"}
    rules = [{"alert": "A", **rule, "inhibits": inhibits}, {"alert": "B", **rule}]
    return yaml.safe_dump({"groups": [{"name": "g", "rules": rules}]}, sort_keys=False)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("Nope", "inhibits 'Nope', which is not a rule in this file"),
        ("A", "rule 'A' cannot inhibit itself"),
    ],
)
def test_a_rule_file_names_only_its_own_other_rules(target: str, message: str) -> None:
    text = _pack([target])
    line = next(
        n for n, text_line in enumerate(text.splitlines(), 1) if text_line.strip() == f"- {target}"
    )
    with pytest.raises(RuleFileError) as caught:
        load_rules_text(text, source="r.yaml")
    assert f"r.yaml:{line}: groups[0].rules[0].inhibits[0]: {message}" in str(caught.value)
    assert load_rules_text(_pack(["B"]))[0].inhibits == ("B",)


def _alertname(matchers: list[str]) -> str | None:
    found = [re.fullmatch(r'alertname\s*=\s*"(\w+)"', m) for m in matchers]
    return found[0].group(1) if len(found) == 1 and found[0] is not None else None


@pytest.mark.parametrize(
    "path", ["deploy/alertmanager/alertmanager.yml", "deploy/fleet/k8s/alertmanager.yaml"]
)
def test_the_shipped_alertmanager_configs_inhibit_what_the_rules_do(path: str) -> None:
    docs = list(yaml.safe_load_all((ROOT / path).read_text()))
    config = next(
        yaml.safe_load(d["data"]["alertmanager.yml"]) if "data" in d else d
        for d in docs
        if d and ("inhibit_rules" in d or "alertmanager.yml" in d.get("data", {}))
    )
    rules = {r.name for r in load_default_rules()}
    pairs = set()
    for inhibit in config["inhibit_rules"]:
        source = _alertname(inhibit["source_matchers"])
        target = _alertname(inhibit["target_matchers"])
        if source in rules and target in rules:
            assert inhibit.get("equal") == ["training_job"], inhibit
            pairs.add((source, target))
    assert pairs == default_inhibition().pairs
