"""The HTML post-mortem: built from a real recorded trace, parsed, and checked to be
self-contained; traces missing signals render with "not recorded" panels."""

from __future__ import annotations

import io
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from gradwatch.cli import main
from gradwatch.report import build_report, load_report_data, write_report
from gradwatch.wire.census import Census
from gradwatch.wire.trace import (
    TraceAct,
    TraceEval,
    TraceHeader,
    TraceStats,
    TraceStep,
    encode_record,
)
from tests.report.recorded import JOB, NAN_STEP, STEPS
from tests.report.synthetic import write_synthetic_trace

SECTIONS = (
    "summary",
    "loss",
    "lr",
    "grad-norm",
    "layers",
    "ratio",
    "activations",
    "census",
    "loss-scale",
    "alerts",
)
# Attributes through which a page pulls something in from elsewhere.
FETCHING = {
    "src",
    "href",
    "srcset",
    "xlink:href",
    "data",
    "poster",
    "action",
    "formaction",
    "background",
}


class Page(HTMLParser):
    """Sections with their text, every tag, and every attribute that could fetch a resource."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, str] = {}
        self.tags: list[str] = []
        self.fetching: list[tuple[str, str, str]] = []
        self.styles = ""
        self._section: str | None = None
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        attributes = dict(attrs)
        if tag == "section":
            self._section = attributes.get("id") or ""
            self.sections[self._section] = ""
        self._in_style = tag == "style"
        for name, value in attrs:
            if name in FETCHING or (name == "style" and value and "url(" in value):
                self.fetching.append((tag, name, value or ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self._section = None
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles += data
        if self._section is not None:
            self.sections[self._section] += data


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def assert_self_contained(page: Page, html: str) -> None:
    assert page.fetching == [], page.fetching
    assert not {"script", "link", "img", "iframe", "object", "embed", "image", "use"} & set(
        page.tags
    )
    assert "url(" not in page.styles and "@import" not in page.styles
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html


def test_a_recorded_trace_becomes_a_self_contained_post_mortem(
    recorded_trace: Path, tmp_path: Path
) -> None:
    out = write_report(recorded_trace, tmp_path / "out" / "report.html")
    html = out.read_text(encoding="utf-8")
    page = parse(html)
    assert tuple(page.sections) == SECTIONS
    assert_self_contained(page, html)
    summary = page.sections["summary"]
    assert JOB in summary and f"1–{STEPS} ({STEPS})" in summary
    assert f"step {NAN_STEP}: NonFiniteGradients" in summary
    assert "Verdict: numerical instability (first alert" in summary
    alerts = page.sections["alerts"]
    assert (
        "A1 critical" in alerts
        and "NonFiniteGradients" in alerts
        and f"from step {NAN_STEP}" in alerts
    )
    assert "Diagnosis: numerical instability" in alerts and "Next checks" in alerts
    assert (
        "latest_finite_loss" in alerts and "ckpt/25.pt" in alerts
    )  # evidence, last good checkpoint
    # The recorded run has evals and activation stats but no AMP: only that panel is empty.
    assert "not recorded" in page.sections["loss-scale"]
    for name in ("loss", "lr", "grad-norm", "layers", "ratio", "activations"):
        assert "not recorded" not in page.sections[name], name
    assert "0.weight" in page.sections["layers"] and "4.bias" in page.sections["layers"]
    assert html.count("<svg") == 8
    # Six tensors and 60 steps need no binning: one cell per tensor and step.
    assert "Each cell is one parameter tensor at one step" in page.sections["layers"]
    assert "the lr was 0.02" in page.sections["lr"]  # constant SGD lr at the NaN alert
    assert "The lr never rose" in page.sections["lr"]
    assert 'class="badge">A1<' in html  # the alert is marked on the charts


def test_report_data_follows_the_trace(recorded_trace: Path) -> None:
    data = load_report_data(recorded_trace)
    assert data.job == JOB and list(data.steps) == list(range(1, STEPS + 1))
    assert data.layer_norms.shape == (6, STEPS)
    # The step-60 eval's loss is NaN (after the NaN input): the recorder keeps it as NaN.
    assert list(data.eval_steps) == [20, 40, 60] and data.rank == 0
    assert {s.kind for s in data.acts.values()} == {"tanh", "relu"}
    ratio, first, last = data.first_last_ratio()
    assert (first, last) == ("0", "4") and ratio[0] > 0
    assert [a.rule for a in data.alerts] == ["NonFiniteGradients"]


def test_a_one_shot_stream_of_lines_is_enough(tmp_path: Path) -> None:
    trace = write_synthetic_trace(tmp_path / "t.jsonl", layers=8, steps=300)
    lines = iter(trace.read_text(encoding="utf-8").splitlines(keepends=True))
    data = load_report_data(lines, source="piped")  # an iterator can be read only once
    assert data.layer_norms.shape == (8, 300) and np.isfinite(data.layer_norms).all()
    assert data.lr.shape == (1, 300) and data.lr[0, 0] > 0
    assert [a.rule for a in data.alerts] == [a.rule for a in load_report_data(trace).alerts]


def write_trace(path: Path, records: list) -> Path:
    path.write_text("".join(encode_record(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_a_trace_with_nothing_but_a_header_renders_every_panel_as_not_recorded(
    tmp_path: Path,
) -> None:
    html = build_report(write_trace(tmp_path / "empty.jsonl", [TraceHeader(job="empty")]))
    page = parse(html)
    assert tuple(page.sections) == SECTIONS
    for name in ("loss", "lr", "grad-norm", "layers", "ratio", "census", "loss-scale"):
        assert "not recorded" in page.sections[name], name
    assert page.sections["activations"].count("not recorded") == 2
    assert (
        "none recorded" in page.sections["summary"] and "no alert fired" in page.sections["summary"]
    )


def test_amp_stats_other_ranks_and_bad_lines(tmp_path: Path) -> None:
    layers = ("emb.weight", "out.weight")
    records: list = [TraceHeader(job="amp", layers=layers, dtype_max=65504.0)]
    for step in range(1, 41):
        scale = 65536.0 / 2 ** (step // 10)
        for rank in (1, 2):  # no rank 0: the curves follow rank 1
            records.append(
                TraceStep(
                    step=step,
                    rank=rank,
                    time=float(step),
                    loss=2.0 - step / 40,
                    lr=(0.1,),
                    grad_norm=1.0,
                    layer_grad_norms=(1e-4, 1.0),
                    loss_scale=scale,
                )
            )
        if step % 10 == 0:
            records.append(
                TraceStats(
                    step=step,
                    rank=1,
                    time=float(step),
                    act=(TraceAct("act", "tanh", 0.0, 0.9, None, min(1.0, step / 40)),),
                )
            )
    records.append(TraceEval(step=40, rank=1, time=40.0, loss=1.5))
    path = write_trace(tmp_path / "amp.jsonl", records)
    with path.open("a", encoding="utf-8") as f:
        f.write('{"type": "step", "step": "x"}\n')
    page = parse(build_report(path))
    assert "not recorded" not in page.sections["loss-scale"]
    assert "not recorded" in page.sections["activations"]  # no ReLU: its dead-fraction panel
    assert "act (tanh)" in page.sections["activations"]
    assert "Curves follow rank 1" in page.sections["summary"]
    assert "1 bad line(s) skipped" in page.sections["summary"]
    assert "×100" in page.sections["ratio"]  # a 1e4 ratio: the vanishing-gradient alert's picture
    assert "LayerGradNormRatioVanishing" in page.sections["alerts"]
    assert "from step 5, rank 1" in page.sections["alerts"]


def test_the_census_section_shows_frozen_tied_and_eval_mode(tmp_path: Path) -> None:
    layers = ("wte.weight", "head.bias")
    records: list = [TraceHeader(job="census", layers=layers, layer_roles=("tied", "bias"))]
    for step in (1, 10, 20):
        records.append(
            TraceStep(step=step, time=float(step), loss=1.0, layer_grad_norms=(1.0, 1.0))
        )
        census = Census(
            params_total=1000,
            params_trainable=590,
            params_frozen=400,
            params_not_in_optimizer=10,
            frozen_modules=(("backbone", 400),),
            not_in_optimizer=("neck.weight",),
            tied=(("wte.weight", "lm_head.weight"),),
            eval_modules=("drop",) if step >= 10 else (),
            model_training=step < 10,
        )
        records.append(
            TraceStats(
                step=step,
                time=float(step),
                act=(
                    TraceAct("mlp.act", "gelu", 0.1, 0.5, 0.95, None),
                    TraceAct("attn.softmax", "softmax", 0.1, 0.2, None, 0.4),
                ),
                census=census,
            )
        )
    section = parse(build_report(write_trace(tmp_path / "c.jsonl", records))).sections
    text = section["census"]
    assert "400 (40.0%)" in text and "backbone (400)" in text and "neck.weight" in text
    assert "wte.weight = lm_head.weight" in text and "drop" in text
    assert "NO (training in eval mode)" in text and "2 sampled step(s), first at step 10" in text
    assert (
        "mlp.act (gelu)" in section["activations"]
        and "attn.softmax (softmax)" in section["activations"]
    )


def test_the_cli_writes_the_report_and_explains_failures(
    recorded_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(recorded_trace), "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert f"wrote {out}" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2
    assert "check the trace path" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "step"}\n', encoding="utf-8")
    assert main(["report", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "gradwatch collector --record" in err and f"{bad}:1:" in err  # the trace is named
    rules = tmp_path / "rules.yaml"
    rules.write_text("groups: [{bad: 1}]\n", encoding="utf-8")
    assert main(["report", str(recorded_trace), "--rules", str(rules), "-o", str(out)]) == 2
    assert capsys.readouterr().err.startswith("gradwatch report:")


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_the_cli_draws_progress_only_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(
        tmp_path / "run.jsonl",
        [TraceHeader(job="p", layers=("w",))]
        + [
            TraceStep(step=s, time=float(s), loss=1.0, lr=(0.1,), layer_grad_norms=(1.0,))
            for s in range(1, 50)
        ],
    )
    assert main(["report", str(trace), "-o", str(tmp_path / "piped.html")]) == 0
    assert capsys.readouterr().err == ""
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert main(["report", str(trace), "-o", str(tmp_path / "screen.html")]) == 0
    assert "report run.jsonl" in screen.getvalue()
    # The bar goes to stderr only: the page is the same.
    piped, shown = (
        (tmp_path / f"{n}.html").read_text(encoding="utf-8") for n in ("piped", "screen")
    )
    assert _without_time(piped) == _without_time(shown)


def _without_time(html: str) -> str:
    return re.sub(r"Generated [0-9: -]+ UTC", "", html)
