"""A stand-in for ``tyro.cli``: a dataclass's fields as command-line flags, as tyro names
them (``--total-timesteps 1000``; a bool as ``--anneal-lr`` / ``--no-anneal-lr``), for
CleanRL's scripts (cleanrl_trial.py). Only fields of bool, int, float and str."""

import argparse
import dataclasses
import sys
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def cli(cls: type[T], args: list[str] | None = None) -> T:
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(prog=sys.argv[0])
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        flag, kind = f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            p.add_argument(f"--{flag}", dest=f.name, action="store_true")
            p.add_argument(f"--no-{flag}", dest=f.name, action="store_false")
        else:
            convert = kind if kind in (int, float, str) else str
            p.add_argument(f"--{flag}", dest=f.name, type=convert)
        p.set_defaults(**{f.name: f.default})
    parsed: Any = vars(p.parse_args(args))
    return cls(**parsed)
