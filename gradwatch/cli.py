"""The ``gradwatch`` command: dispatches to the part that owns each subcommand.

Imports are lazy so ``gradwatch collector`` never imports torch and
``gradwatch --help`` stays instant. A base install (``pip install gradwatch``)
has none of the extras; a command that needs one says which, in one line,
instead of ending in an ImportError traceback. Output into a pipe that closes
early (``gradwatch replay ... | head``) ends the command quietly, as a Unix
tool does.

Example::

    from gradwatch.cli import main
    raise SystemExit(main(["replay", "traces/run-42.jsonl", "--json"]))
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

from gradwatch.logs import LogFormat, configure_logging

USAGE = """usage: gradwatch [--version] [--log-format text|json] COMMAND [ARGS...]

commands:
  collector     run the collector daemon (ingest, rules, /metrics, alert webhooks)
  rules check   validate a rule file and list every error with its line
  replay FILE   run the rules over a recorded trace; print the alerts it would raise
  report TRACE  write a self-contained HTML post-mortem of a trace (-o report.html)
  grafana push  create or replace the gradwatch dashboard in Grafana
  restart-hook  run one allow-listed command when a signed alert arrives
  keys          CurveZMQ key pairs and the collector's allow-list (SECURITY.md)
  demo          agent + collector + rules + alert on loopback; ends by itself
  version       print the version (also: gradwatch --version)

--log-format json: log lines (warnings, the collector's logs) as one JSON object
each, for cluster log collectors; the collector also reads GRADWATCH_LOG_FORMAT.

Run 'gradwatch COMMAND --help' for a command's options.
"""

# The importable modules each extra brings (pyproject.toml [project.optional-dependencies]);
# tests/packaging checks this table against pyproject.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "agent": ("torch",),
    "collector": (
        "numpy",
        "pydantic",
        "pydantic_settings",
        "yaml",
        "prometheus_client",
        "grafana_client",
        "tqdm",
    ),
    "preflight": ("torch", "matplotlib", "tqdm"),
    "hf": ("torch", "transformers", "accelerate"),
    "lightning": ("torch", "lightning"),
}

# The extras each command needs; a command not listed runs on the base install.
COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "collector": ("collector",),
    "rules": ("collector",),
    "replay": ("collector",),
    "report": ("collector",),
    "grafana": ("collector",),
    "restart-hook": ("collector",),
    "keys": ("collector",),
    "demo": ("agent", "collector"),
}

# 128 + SIGPIPE: what a shell reports for a tool that stopped because its reader went away.
EXIT_BROKEN_PIPE = 141


def install_hint(extras: Sequence[str]) -> str:
    """The pip command that brings ``extras``, quoted for a shell."""
    return f"pip install 'gradwatch[{','.join(extras)}]'"


def missing_extras(command: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The extras ``command`` needs that are not installed, and their missing modules."""
    extras: list[str] = []
    modules: list[str] = []
    for extra in COMMAND_EXTRAS.get(command, ()):
        absent = [m for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]
        if absent:
            extras.append(extra)
            modules += [m for m in absent if m not in modules]
    return tuple(extras), tuple(modules)


def extra_for_module(module: str) -> str | None:
    """The extra that brings top-level ``module``, or None when no extra does."""
    top = module.partition(".")[0]
    return next((extra for extra, mods in EXTRA_MODULES.items() if top in mods), None)


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
    print(f"gradwatch {version()}")
    return 0


def version() -> str:
    """The installed distribution's version (the one pip reports), else the source tree's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gradwatch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from gradwatch import __version__

        return __version__


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
    """Run ``gradwatch ARGS``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        log_format, args = _log_format(args)
    except ValueError as exc:
        print(f"{exc}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        args[0] = "version"
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"gradwatch: unknown command {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    extras, modules = missing_extras(args[0])
    if extras:
        return _need(args[0], extras, modules)
    if log_format is not None:
        if args[0] == "collector":  # it configures logging from its own settings
            args[1:1] = ["--log-format", log_format]
        else:
            configure_logging("WARNING", log_format)
    try:
        try:
            return command(args[1:])
        finally:
            # Here, not at interpreter exit (argparse's --help exits too), so that a
            # closed pipe is caught below instead of printed as "Exception ignored".
            sys.stdout.flush()
    except BrokenPipeError:
        return _closed_pipe()
    except ModuleNotFoundError as exc:
        extra = extra_for_module(exc.name or "")
        if extra is None:
            raise
        return _need(args[0], (extra,), (exc.name or "?",))


def _log_format(args: list[str]) -> tuple[LogFormat | None, list[str]]:
    """Take a leading ``--log-format X`` off ``args``; ``ValueError`` when X is no format."""
    if not args or args[0].partition("=")[0] != "--log-format":
        return None, args
    _, eq, value = args[0].partition("=")
    rest = args[1:]
    if not eq:
        value, rest = (rest[0], rest[1:]) if rest else ("", rest)
    if value == "json":
        return "json", rest
    if value == "text":
        return "text", rest
    raise ValueError(f"gradwatch: --log-format takes text or json, not {value!r}")


def _need(command: str, extras: Sequence[str], modules: Sequence[str]) -> int:
    print(
        f"gradwatch {command}: needs the {', '.join(extras)} extra{'s' * (len(extras) > 1)} "
        f"({', '.join(modules)} not installed): {install_hint(extras)}",
        file=sys.stderr,
    )
    return 2


def _closed_pipe() -> int:
    # The reader is gone: point stdout at /dev/null so the interpreter's final
    # flush does not raise again (the recipe of Python's signal module docs).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in a test)
        pass
    return EXIT_BROKEN_PIPE
