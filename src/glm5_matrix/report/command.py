"""The matrix report: every cell of the matrix and what its results folder says, for a person
(report.html, glm5_matrix.report.page), for a CI summary (report.md) and for a CI test view
(junit.xml merged over the cells, each test named with its cell id).

Reads only matrix data and results folders (results/SLUG/{context.json, results.json,
junit.xml}); writes only into its output folder, each file replaced atomically. A cell is
passed, failed, skipped (with the reason: preflight's, or every test's), not run (no results
folder) or interrupted (results.json says "complete": false, or the folder has none). Keys that
later runs add (complete, ended, engine_starts[].compile, figures) are read where present.

    glm5-matrix report [RESULTS] [--output DIR] [--check-browser]      (nox -s report -- ...)
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.matrix.matrix import MATRIX_FILE, Matrix, load_matrix
from glm5_matrix.report.junit import merged_junit
from glm5_matrix.report.markdown import markdown
from glm5_matrix.report.model import MatrixReport, collect
from glm5_matrix.results.schema import results_base

REPORT_DIR = "report"


FILES = ("report.md", "report.html", "junit.xml")


def write(report: MatrixReport, out: Path) -> list[Path]:
    """report.md, report.html and junit.xml into `out`, each written beside its target and
    renamed into place; other files in `out` (a screenshot) are left alone."""
    from glm5_matrix.report.page import render

    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".staging-{os.getpid()}"
    staging.mkdir()
    try:
        (staging / "report.md").write_text(markdown(report))
        (staging / "report.html").write_text(render(report))
        merged_junit(report).write(str(staging / "junit.xml"), pretty=True)
        written = []
        for name in FILES:
            os.replace(staging / name, out / name)
            written.append(out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="the matrix report (report.md, report.html, merged junit.xml) from results/",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("results", nargs="?", type=Path, help="results folder (default results/)")
    parser.add_argument("--output", type=Path, help="where to write (default RESULTS/report)")
    parser.add_argument("--matrix", type=Path, help="the matrix file (default: the checkout's)")
    parser.add_argument(
        "--check-browser",
        action="store_true",
        help="load report.html in headless Chromium: no console error, no request, every cell "
        "and test on it, the verdict and first failure on its first screen, every comparison "
        "drawn right, each collapsed section working; writes report.png beside it (exit 1 "
        "when a check fails)",
    )
    parser.set_defaults(func=_run, preflight=_preflight)


def _folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """(the results folder, the report's folder) the arguments name."""
    results_dir = args.results or results_base(os.environ)
    return results_dir, args.output or results_dir / REPORT_DIR


def _preflight(args: argparse.Namespace) -> Matrix:
    """The inputs checked before anything is written (and, under `nox -s report`, before the
    harness environment is built): the results folder, the report's folder, the matrix."""
    from glm5_matrix.files import repo_root

    results_dir, out = _folders(args)
    if not results_dir.is_dir():
        what = "not a folder" if results_dir.exists() else "results folder not found"
        raise UserError(f"{results_dir}: {what}")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: not a folder (--output names the folder to write the report in)")
    return load_matrix(args.matrix or repo_root() / MATRIX_FILE)


def _run(args: argparse.Namespace) -> int:
    results_dir, out = _folders(args)
    matrix = _preflight(args)
    report = collect(matrix, results_dir, exclude=(out,))
    for path in write(report, out):
        print(f"wrote {path}")
    print(report.headline())
    if args.check_browser:
        from glm5_matrix.report import browser

        checked = browser.check_report(out / "report.html", report, out / "report.png")
        print(checked.describe())
        if not checked.ok:
            return 1
    return 0
