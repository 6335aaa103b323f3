"""What the collector's and the restart hook's settings share: reading values, listing settings.

``CollectorConfig`` (``config.py``) and ``HookConfig`` (``restart_hook.py``)
read single values the same way: an environment variable's list (a JSON list
or commas), ``HOST:PORT``, an http(s) URL; each problem is a ``ValueError``
whose message pydantic shows next to the key. Their commands' ``--help`` lists
every setting the same way: config-file key, environment variable (the model's
``env_prefix`` + the key in capitals), the flag that sets it if any, its default
and description, so that nothing configurable is hidden from ``--help``.

Example::

    split_list("http://a:1, http://b:2")     # ["http://a:1", "http://b:2"]
    split_host_port("[::1]:9400")             # ("::1", 9400)

    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen")
    parser.epilog = settings_help(HookConfig, parser, ["settings: ..."])
    # "  listen  GRADWATCH_HOOK_LISTEN  --listen  (default: 127.0.0.1:9402)"
    # "      HOST:PORT to bind."
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings


def split_list(value: Any, items: str = "URLs") -> Any:
    """An environment variable's one string as a list: a JSON list, or comma-separated.

    Anything but a string (a YAML list, a flag's list) is returned as it is;
    ``items`` names what the list holds in the error message.
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except RecursionError:  # pydantic reports ValueError, not this
            raise ValueError(
                f"a JSON list nested too deeply; give a flat list of {items}"
            ) from None
    return [part.strip() for part in text.split(",") if part.strip()]


def is_http_url(url: str) -> bool:
    """True for an ``http://`` or ``https://`` URL that names a host."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def split_host_port(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:9400"`` -> ``("127.0.0.1", 9400)``; ``"[::1]:0"`` and ``":9400"`` too."""
    host, sep, port = addr.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT with a port from 0 to 65535, e.g. 127.0.0.1:9400")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def env_prefix(model: type[BaseSettings]) -> str:
    """The prefix of ``model``'s environment variables, in capitals (``GRADWATCH_``)."""
    return str(model.model_config.get("env_prefix", "")).upper()


def settings_help(
    model: type[BaseSettings], parser: argparse.ArgumentParser, intro: Sequence[str]
) -> str:
    """``intro``, a blank line, then two or more lines per field of ``model``.

    Meant for ``parser.epilog`` with ``argparse.RawDescriptionHelpFormatter``
    (other formatters rewrap the lines into one paragraph).
    """
    flags = {
        action.dest: action.option_strings[0] for action in parser._actions if action.option_strings
    }
    prefix = env_prefix(model)
    lines = [*intro, ""]
    for name, field in model.model_fields.items():
        lines += setting_lines(name, field, prefix, flags.get(name))
    return "\n".join(lines)


def setting_lines(name: str, field: FieldInfo, prefix: str, flag: str | None) -> list[str]:
    """``  key  ENV_VAR  [--flag]  (default: ...)`` and the description, wrapped at 88."""
    default = field.get_default(call_default_factory=True)
    shown = (
        "none"
        if default is None or default is PydanticUndefined
        else str(default).lower()
        if isinstance(default, bool)
        else str(default)
    )
    if isinstance(default, (list, dict)) and not default:
        shown = "empty"
    head = f"  {name}  {prefix}{name.upper()}" + (f"  {flag}" if flag else "")
    about = field.description or _choices(field) or ""
    body = textwrap.wrap(about, width=88, initial_indent="      ", subsequent_indent="      ")
    return [f"{head}  (default: {shown})", *body]


def _choices(field: FieldInfo) -> str:
    # A Literal["a", "b"] without a description still says what it takes.
    args = getattr(field.annotation, "__args__", ())
    return (
        "one of " + ", ".join(str(a) for a in args)
        if args and all(isinstance(a, str) for a in args)
        else ""
    )


__all__ = [
    "env_prefix",
    "is_http_url",
    "setting_lines",
    "settings_help",
    "split_host_port",
    "split_list",
]
