"""Logging set-up for the entry points: readable text, or one JSON object per line.

Libraries only call ``logging.getLogger(__name__)``; the commands (the
collector daemon, the restart hook, long one-shot commands) call
``configure_logging`` once. ``json`` is for cluster log collectors (Loki,
Fluent Bit, Cloud Logging): each record is one line with ``time`` (RFC 3339,
UTC), ``level``, ``logger``, ``message``, ``exc_info`` when there is a
traceback, and any ``extra=`` fields the call passed.

Example::

    from gradwatch.logs import configure_logging
    configure_logging("INFO", "json")
    logging.getLogger("gradwatch.collector").info("ready", extra={"port": 9400})
    # {"time": "2026-01-05T10:00:00.123Z", "level": "INFO", "logger": "gradwatch.collector",
    #  "message": "ready", "port": 9400}
"""

from __future__ import annotations

import json
import logging
import math
import sys
from datetime import datetime, timezone
from typing import Any, Literal, TextIO, get_args

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord carries; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """One strict JSON object per record (NaN and non-JSON values become strings)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            body["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            body["stack_info"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in body:
                body[key] = value
        try:
            return json.dumps(body, ensure_ascii=False, allow_nan=False, default=str)
        except ValueError:  # a NaN or infinity in extra=: a log line must still come out
            return json.dumps(
                {k: _finite(v) for k, v in body.items()}, ensure_ascii=False, default=str
            )


def _finite(value: Any) -> Any:
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else value


def configure_logging(
    level: str | int = "INFO", log_format: LogFormat = "text", stream: TextIO | None = None
) -> bool:
    """Send the root logger's records to ``stream`` (stderr) as text or JSON lines.

    Like ``logging.basicConfig``, a no-op returning False when the root logger
    already has handlers: a program that embeds a command (or pytest) keeps its own.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}; use one of {', '.join(LOG_FORMATS)}")
    root = logging.getLogger()
    if root.handlers:
        return False
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root.addHandler(handler)
    root.setLevel(level)
    return True


__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "LogFormat",
    "configure_logging",
]
