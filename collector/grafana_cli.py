"""``gradwatch grafana push``: send the gradwatch dashboard to a Grafana.

The URL and token come from flags or, like the collector's settings, from
``GRADWATCH_GRAFANA_URL`` and ``GRADWATCH_GRAFANA_TOKEN``; ``--token-file``
reads a mounted secret. The dashboard pushed by default is the one installed
with the package (``packaged_dashboard()``). Exit statuses: 0 pushed; 1 Grafana refused or could
not be reached; 2 bad usage (no URL, no token, unreadable dashboard).

Example::

    from gradwatch.collector.grafana_cli import grafana_main
    raise SystemExit(grafana_main(["push", "--url", "http://grafana:3000",
                                   "--token-file", "/run/secrets/grafana-token"]))
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from gradwatch.collector.grafana import GrafanaError, load_dashboard, push_dashboard


def packaged_dashboard() -> Path:
    """The dashboard JSON installed with the package (``gradwatch/collector/dashboards/``)."""
    return Path(str(files("gradwatch.collector") / "dashboards" / "gradwatch.json"))


DEFAULT_DASHBOARD = packaged_dashboard()


def grafana_parser(prog: str = "gradwatch grafana") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Work with Grafana.")
    commands = parser.add_subparsers(dest="command", required=True)
    push = commands.add_parser("push", help="create or replace the gradwatch dashboard")
    push.add_argument(
        "--url",
        default=os.environ.get("GRADWATCH_GRAFANA_URL"),
        help="Grafana base URL (default $GRADWATCH_GRAFANA_URL)",
    )
    push.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding a service-account token (default $GRADWATCH_GRAFANA_TOKEN)",
    )
    push.add_argument(
        "--dashboard",
        type=Path,
        default=DEFAULT_DASHBOARD,
        metavar="FILE",
        help=f"dashboard JSON (default: the one installed with gradwatch, {DEFAULT_DASHBOARD})",
    )
    push.add_argument("--folder-uid", help="put the dashboard in this folder")
    push.add_argument(
        "--no-overwrite",
        dest="overwrite",
        action="store_false",
        help="fail (412) instead of replacing a dashboard changed in Grafana",
    )
    return parser


def grafana_main(argv: Sequence[str] | None = None) -> int:
    """``gradwatch grafana push``; see the module docstring."""
    args = grafana_parser().parse_args(argv)
    if not args.url:
        return _fail("no Grafana URL: pass --url or set GRADWATCH_GRAFANA_URL", 2)
    try:
        token = _token(args.token_file)
        load_dashboard(args.dashboard)
    except GrafanaError as exc:
        return _fail(str(exc), 2)
    try:
        answer = push_dashboard(
            args.url, token, args.dashboard, folder_uid=args.folder_uid, overwrite=args.overwrite
        )
    except GrafanaError as exc:
        return _fail(str(exc), 1)
    print(
        f"pushed {args.dashboard}: uid {answer.get('uid')}, version {answer.get('version')}, "
        f"{answer.get('url')}"
    )
    return 0


def _token(path: Path | None) -> str:
    if path is not None:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise GrafanaError(f"cannot read the token file {path}: {exc.strerror or exc}") from exc
    else:
        token = os.environ.get("GRADWATCH_GRAFANA_TOKEN", "").strip()
    if not token:
        raise GrafanaError(
            "no Grafana token: pass --token-file FILE or set "
            "GRADWATCH_GRAFANA_TOKEN (a service-account token, Editor role)"
        )
    return token


def _fail(message: str, status: int) -> int:
    print(f"gradwatch grafana: {message}", file=sys.stderr)
    return status


__all__ = ["DEFAULT_DASHBOARD", "grafana_main", "grafana_parser", "packaged_dashboard"]
