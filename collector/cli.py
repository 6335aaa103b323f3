"""Command lines of the collector: parse, configure logging, hand over.

``collector_main(argv)`` is ``gradwatch collector ...``, ``rules_main(argv)``
is ``gradwatch rules check FILE`` and ``replay_main(argv)`` is ``gradwatch
replay FILE``; each returns the process exit status. The
top-level ``gradwatch`` script dispatches to them; ``python -m
gradwatch.collector`` runs ``collector_main`` directly.

Exit statuses: 0 clean stop / rules valid; 1 runtime failure / rules invalid;
2 bad configuration, bad rule file or bad usage. ``gradwatch collector --help``
lists every setting of ``CollectorConfig`` with its environment variable.

Example::

    from gradwatch.collector.cli import collector_main
    raise SystemExit(collector_main(["--listen", "tcp://0.0.0.0:5555", "--per-layer-metrics"]))
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradwatch.collector.config import CollectorConfig, CollectorError, ConfigError, load_config
from gradwatch.collector.settings_common import settings_help
from gradwatch.logs import LOG_FORMATS, configure_logging
from gradwatch.rules import RuleFileError, load_rules

SETTINGS_INTRO = (
    "settings: each is a key of the --config YAML file and a GRADWATCH_<KEY> environment",
    "variable (lists: JSON or comma-separated; routes: JSON). Flags beat the environment,",
    "which beats the file.",
)


def collector_parser(prog: str = "gradwatch collector") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Receive gradwatch agents' signals, evaluate rules, serve "
        "Prometheus metrics and send alerts.\nFlags beat GRADWATCH_* environment variables, "
        "which beat the config file.",
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML config file")
    parser.add_argument(
        "--listen",
        metavar="ENDPOINT",
        help="ZeroMQ endpoint to bind (default tcp://127.0.0.1:5555)",
    )
    parser.add_argument(
        "--metrics-addr",
        metavar="HOST:PORT",
        help="address of /metrics, /healthz, /readyz (default 127.0.0.1:9400)",
    )
    parser.add_argument(
        "--webhook",
        dest="webhooks",
        action="append",
        metavar="URL",
        help="POST alerts as JSON to URL (repeatable)",
    )
    parser.add_argument(
        "--rules", type=Path, metavar="FILE", help="rule file (default: the packaged rule pack)"
    )
    parser.add_argument(
        "--per-layer-metrics",
        action="store_true",
        default=None,
        help="expose gradwatch_layer_grad_norm per layer",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        metavar="FILE",
        help="once ready, write the bound endpoint and metrics URL here as JSON",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="keep durable state (the alert outbox) in DIR; undelivered alerts survive a restart",
    )
    parser.add_argument(
        "--record",
        dest="record_dir",
        type=Path,
        metavar="DIR",
        help="record every job as DIR/<job>.jsonl for `gradwatch replay`",
    )
    parser.add_argument(
        "--log-level", metavar="LEVEL", help="DEBUG, INFO (default), WARNING, ERROR"
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="text (default) or json: one JSON object per line for cluster log collectors",
    )
    parser.epilog = settings_help(CollectorConfig, parser, SETTINGS_INTRO)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def collector_main(argv: Sequence[str] | None = None) -> int:
    """``gradwatch collector``: run until SIGTERM/SIGINT; see the module docstring."""
    args = collector_parser().parse_args(argv)
    overrides: dict[str, Any] = {
        "listen": args.listen,
        "metrics_addr": args.metrics_addr,
        "webhooks": args.webhooks,
        "rules": args.rules,
        "per_layer_metrics": args.per_layer_metrics,
        "ready_file": args.ready_file,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "record_dir": args.record_dir,
        "data_dir": args.data_dir,
    }
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    configure_logging(config.log_level, config.log_format)
    from gradwatch.collector.server import Server  # here: `rules check` and `replay` never need it

    try:
        return Server(config).run_until_signal()
    except RuleFileError as exc:
        return _fail(
            f"{exc}\nFix the rule file (check it with `gradwatch rules check FILE`) "
            "or leave out --rules to use the default pack.",
            2,
        )
    except ConfigError as exc:  # found at start: a profile refusal, a key, a file limit
        return _fail(str(exc), 2)
    except CollectorError as exc:
        return _fail(str(exc), 1)


def rules_parser(prog: str = "gradwatch rules") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Work with rule files.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate rule files; exit 1 if any is invalid")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    return parser


def rules_main(argv: Sequence[str] | None = None) -> int:
    """``gradwatch rules check FILE...``: print every problem; 0 if all valid, else 1."""
    args = rules_parser().parse_args(argv)
    status = 0
    for path in args.files:
        try:
            specs = load_rules(path)
        except RuleFileError as exc:
            print(exc, file=sys.stderr)
            status = 1
            continue
        print(f"{path}: {len(specs)} rule(s) OK")
    return status


def replay_parser(prog: str = "gradwatch replay") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the rules over a recorded trace (JSON Lines) and print the "
        "alerts they would have raised. Exit 0 when the trace was read, alerts or not.",
    )
    parser.add_argument(
        "file",
        type=Path,
        metavar="FILE",
        help="trace file (collector --record), or a training log to backtest: a Hugging "
        "Face trainer_state.json(.gz) or a Lightning CSVLogger metrics.csv",
    )
    parser.add_argument(
        "--rules", type=Path, metavar="FILE", help="rule file (default: the packaged rule pack)"
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per alert transition, one per line"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail on the first bad line instead of skipping bad lines",
    )
    return parser


def replay_main(argv: Sequence[str] | None = None) -> int:
    """``gradwatch replay FILE [--rules FILE] [--json] [--strict]``.

    See ``gradwatch.collector.replay``.
    """
    from gradwatch.collector.replay import run_replay

    args = replay_parser().parse_args(argv)
    return run_replay(args.file, args.rules, json_lines=args.json, strict=args.strict)


def restart_hook_main(argv: Sequence[str] | None = None) -> int:
    """``gradwatch restart-hook [--config FILE] ... -- ARGV``.

    See ``gradwatch.collector.restart_hook``.
    """
    from gradwatch.collector.restart_hook import hook_main

    return hook_main(argv)


def _fail(message: str, status: int) -> int:
    print(f"gradwatch collector: {message}", file=sys.stderr)
    return status


__all__ = [
    "collector_main",
    "collector_parser",
    "replay_main",
    "replay_parser",
    "restart_hook_main",
    "rules_main",
    "rules_parser",
]
