"""Reading a collector config file, and saying what is wrong with a configuration.

:func:`read_config_file` turns a YAML file into the mapping ``load_config``
validates, with a precise message for every way a file can be unreadable;
:func:`describe_errors` turns pydantic's validation errors into one message
that names each bad key and never echoes a secret (tokens ride in webhook URLs).
Both are pure apart from reading the one file; ``gradwatch.collector.config``
wraps their messages in a ``ConfigError``.

Example::

    from pathlib import Path

    values = read_config_file(Path("collector.yaml"))   # {"metrics_addr": "0.0.0.0:9400", ...}
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


def read_config_file(path: Path) -> dict[str, Any]:
    """The YAML mapping in ``path``, keys in field spelling; raises ``ValueError`` saying
    what is wrong with the file and what to do."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(
            f"cannot read config file {path}: {exc.strerror or exc}; "
            "check the --config path or leave it out to use defaults"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"config file {path} is not UTF-8 text ({exc}); point --config at the YAML file"
        ) from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ValueError(
            f"config file {path} is nested too deeply to read; "
            "a config file is a flat mapping of keys to values"
        ) from exc
    except ValueError as exc:  # a date like 2024-13-45, an integer of over 4300 digits
        raise ValueError(
            f"config file {path} has a value YAML cannot read ({exc}); fix it or quote it"
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"config file {path} must hold a mapping of keys to values, not a {type(data).__name__}"
        )
    # Accept the flag spelling (metrics-addr) as well as the field name.
    return {str(key).replace("-", "_"): value for key, value in data.items()}


# Keys whose values may be or embed secrets (tokens in URLs): never echoed in errors.
_UNECHOED = (
    "webhook",
    "slack",
    "pagerduty_routing_key",
    "alertmanager_urls",
    "grafana_token",
    "command_key",
    "metrics_basic_auth_password",
)


# Bounded: the full repr of a YAML alias bomb would take minutes and gigabytes.
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def describe_errors(exc: ValidationError, path: Path | None, fields: Iterable[str]) -> str:
    """One message for every invalid key of ``exc``, secrets never echoed; ``fields`` are
    the valid keys, listed for an unknown one."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(config)"
        if error["type"] == "extra_forbidden":
            known = ", ".join(sorted(fields))
            lines.append(f"  {key}: unknown key; valid keys are {known}")
            continue
        message = error["msg"].removeprefix("Value error, ")
        # Webhook URLs may embed tokens: never echo them back, nor a whole-config
        # input (a cross-field check's), which holds every secret that was set.
        secret = key.startswith(_UNECHOED) or key == "(config)"
        got = "" if secret else f" (got {_REPR.repr(error.get('input')):.80})"
        lines.append(f"  {key}: {message}{got}")
    where = f"the config file {path}, " if path is not None else ""
    return (
        "invalid collector configuration:\n"
        + "\n".join(lines)
        + f"\nFix these keys in {where}the GRADWATCH_<KEY> environment variables "
        "or the command-line flags."
    )
