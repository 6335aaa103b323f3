"""CLI: bad config or rules exit 2 with one clear paragraph; `rules check` exits 0/1."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradwatch.collector.cli import collector_main, rules_main
from gradwatch.rules import default_rules_path

BAD_RULES = """\
groups:
  - name: g
    rules:
      - alert: Broken
        detector: no-such-detector
        severity: loud
"""


def test_bad_config_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert collector_main(["--metrics-addr", "not-an-address"]) == 2
    err = capsys.readouterr().err
    assert "metrics_addr" in err and "HOST:PORT" in err


def test_bad_rule_file_exits_2_before_binding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(BAD_RULES)
    status = collector_main(
        ["--rules", str(rules), "--listen", "tcp://127.0.0.1:*", "--metrics-addr", "127.0.0.1:0"]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert f"{rules}:5" in err and "gradwatch rules check" in err


def test_rules_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert rules_main(["check", str(default_rules_path())]) == 0
    assert "rule(s) OK" in capsys.readouterr().out
    rules = tmp_path / "rules.yaml"
    rules.write_text(BAD_RULES)
    assert rules_main(["check", str(rules)]) == 1
    err = capsys.readouterr().err
    assert f"{rules}:5" in err and f"{rules}:6" in err


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        rules_main([])
    assert info.value.code == 2
