"""Coverage-guided fuzzing of gradwatch's input boundaries with atheris (libFuzzer), for long runs.

The same properties as tests/fuzz, without hypothesis' bounds:

* ``wire``  -- ``decode(frames)`` returns a message or raises ``WireError``; ``Ingest.feed``
  on the same frames never raises, counts at most one rejection, never ``internal``,
  and exactly one rejection when ``decode`` refused the frames.
* ``trace`` -- ``TraceReader`` strict raises ``TraceError`` naming a line in the input;
  lenient never raises past the header and its skipped count matches its problems.
* ``rules`` -- ``load_rules_text`` returns rules or raises ``RuleFileError``, within
  ``SLOW_S`` seconds (YAML alias bombs included).

Any other exception, or a broken property (AssertionError), is a crash: libFuzzer
stops and writes the input to ``crash-<sha1>`` in the working directory.
Without a corpus directory a fresh one is seeded with valid inputs (a batch, a
trace, the default rule pack), so mutation starts from the interesting shapes.

    pip install atheris
    python benchmarks/fuzz_atheris.py wire -atheris_runs=200000
    python benchmarks/fuzz_atheris.py rules -max_total_time=60
    python benchmarks/fuzz_atheris.py trace -max_total_time=60 corpus/trace/
"""

from __future__ import annotations

import json
import logging
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["gradwatch", "yaml"]):
    from gradwatch.collector.ingest import REASONS, Ingest
    from gradwatch.rules.rulefile import (
        RuleFileError,
        default_rules_path,
        load_rules_text,
    )
    from gradwatch.wire import (
        Batch,
        Schema,
        TraceError,
        TraceReader,
        WireError,
        decode,
        encode,
    )

# Frames travel in one fuzz input separated by this marker (seeds use it; mutations may break it).
SEP = b"\n--gw-frame--\n"
SLOW_S = 2.0
HEADER = '{"type":"header","version":1,"job":"run-1","layers":["a","b"]}'


def fuzz_wire(data: bytes) -> None:
    frames = data.split(SEP)
    try:
        decode(frames)
        refused = False
    except WireError:
        refused = True
    ingest = Ingest()
    ingest.feed(frames)
    stats = ingest.stats()
    rejected = sum(stats.rejected.values())
    assert stats.rejected["internal"] == 0, "a valid message crashed Ingest"
    assert rejected == 1 if refused else rejected <= 1, stats.rejected
    assert refused or sum(stats.messages.values()) == 1, stats.messages


def fuzz_trace(data: bytes) -> None:
    # The first byte picks whether a valid header leads, so the body gets fuzzed too.
    text = data[1:].decode("utf-8", "replace")
    lines = ([HEADER] if data[:1] < b"\x80" else []) + text.splitlines(keepends=True)
    try:
        list(TraceReader(lines, strict=True, source="f"))
    except TraceError as exc:
        assert exc.problems and all(1 <= line <= max(len(lines), 1) for line, _ in exc.problems)
    reader = TraceReader(lines, strict=False, source="f")
    try:
        list(reader)
    except TraceError as exc:
        assert exc.problems[0][0] <= max(len(lines), 1)  # only a bad header may raise
        return
    assert reader.skipped >= len(reader.problems)


def fuzz_rules(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    start = time.monotonic()
    try:
        load_rules_text(text, source="f.yaml")
    except RuleFileError as exc:
        assert exc.problems
    elapsed = time.monotonic() - start
    assert elapsed < SLOW_S, f"a {len(data)}-byte rule file took {elapsed:.1f}s"


TARGETS: dict[str, Callable[[bytes], None]] = {
    "wire": fuzz_wire,
    "trace": fuzz_trace,
    "rules": fuzz_rules,
}


def seeds(target: str) -> list[bytes]:
    """Valid inputs of ``target``: where mutation starts."""
    if target == "wire":
        schema = Schema(1, ("loss", "lr/0"), ("a", "b"))
        values = struct.pack("<8f", 2.5, 0.1, 0.5, 0.25, 2.4, 0.1, 0.5, 0.2)
        batch = Batch("run-1", 0, 1, 1, 0, "inc", 0, (1, 2), (1.0, 2.0), values, schema)
        hb = b'GW\x01\x02{"job":"j","rank":0,"world":1,"inc":"i","time":1.0,"step":1,"dropped":0}'
        ev = (
            b"GW\x01\x03"
            + json.dumps(
                {
                    "job": "j",
                    "rank": 0,
                    "inc": "i",
                    "time": 1.0,
                    "kind": "eval",
                    "step": 2,
                    "fields": {"loss": "nan"},
                }
            ).encode()
        )
        return [SEP.join(encode(batch)), hb, ev]
    if target == "trace":
        body = "\n".join(
            json.dumps(record)
            for record in [
                {
                    "type": "step",
                    "step": 1,
                    "loss": 2.5,
                    "lr": [0.1],
                    "layer_grad_norms": [0.5, None],
                },
                {
                    "type": "stats",
                    "step": 1,
                    "layer_weight_norms": [1, 2],
                    "act": {"m": {"mean": 0, "std": 1}},
                },
                {"type": "eval", "step": 2, "loss": "inf", "metrics": {"acc": 0.9}},
                {"type": "event", "step": 2, "kind": "checkpoint", "path": "c.pt"},
                {"type": "heartbeat", "rank": 0, "time": 3.0, "step": 2},
            ]
        )
        return [b"\x00" + body.encode(), b"\xff" + HEADER.encode() + b"\n" + body.encode()]
    small = (
        b"groups:\n  - name: g\n    rules:\n      - alert: A\n        detector: nonfinite\n"
        b"        severity: critical\n        category: numerical\n        for: 2\n"
    )
    bomb = b"a: &a [x, x, x]\nb: &b [*a, *a, *a]\ngroups: [*b, *b]\n"
    return [default_rules_path().read_bytes(), small, bomb]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer flags] [corpus dir]")
    target, rest = argv[1], argv[2:]
    logging.disable(logging.CRITICAL)  # Ingest logs every rejection it counts
    assert set(REASONS) >= {"malformed", "version", "oversized"}
    if not any(not arg.startswith("-") for arg in rest):
        corpus = Path(tempfile.mkdtemp(prefix=f"gradwatch-fuzz-{target}-"))
        for i, seed in enumerate(seeds(target)):
            (corpus / f"seed-{i}").write_bytes(seed)
        rest.append(str(corpus))
        print(f"corpus: {corpus}", file=sys.stderr)
    atheris.Setup([argv[0], *rest], TARGETS[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
