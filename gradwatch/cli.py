"""The ``gradwatch`` command: dispatches to the part that owns each subcommand.

Imports are lazy so ``gradwatch collector`` never imports torch and
``gradwatch --help`` stays instant.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = """usage: gradwatch COMMAND [ARGS...]

commands:
  collector     run the collector daemon (ingest, rules, /metrics, alert webhooks)
  rules check   validate a rule file and list every error with its line
  replay FILE   run the rules over a recorded trace; print the alerts it would raise
  report TRACE  write a self-contained HTML post-mortem of a trace (-o report.html)
  grafana push  create or replace the gradwatch dashboard in Grafana
  restart-hook  run one allow-listed command when a signed alert arrives
  keys          CurveZMQ key pairs and the collector's allow-list (SECURITY.md)
  demo          agent + collector + rules + alert on loopback; ends by itself
  version       print the version

Run 'gradwatch COMMAND --help' for a command's options.
"""


def _collector(argv: Sequence[str]) -> int:
    from gradwatch.collector.cli import collector_main

    return collector_main(argv)


def _rules(argv: Sequence[str]) -> int:
    from gradwatch.collector.cli import rules_main

    return rules_main(argv)


def _replay(argv: Sequence[str]) -> int:
    from gradwatch.collector.cli import replay_main

    return replay_main(argv)


def _grafana(argv: Sequence[str]) -> int:
    from gradwatch.collector.grafana_cli import grafana_main

    return grafana_main(argv)


def _restart_hook(argv: Sequence[str]) -> int:
    from gradwatch.collector.cli import restart_hook_main

    return restart_hook_main(argv)


def _keys(argv: Sequence[str]) -> int:
    from gradwatch.collector.keys import keys_main

    return keys_main(argv)


def _report(argv: Sequence[str]) -> int:
    from gradwatch.report.cli import report_main

    return report_main(argv)


def _demo(argv: Sequence[str]) -> int:
    from gradwatch.demo import main as demo_main

    return demo_main(argv)


def _version(argv: Sequence[str]) -> int:
    from gradwatch import __version__

    print(f"gradwatch {__version__}")
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "collector": _collector,
    "rules": _rules,
    "replay": _replay,
    "report": _report,
    "grafana": _grafana,
    "restart-hook": _restart_hook,
    "keys": _keys,
    "demo": _demo,
    "version": _version,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"gradwatch: unknown command {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return command(args[1:])
