"""The docs site's generated tables: the cells from the matrix, the mutants from the catalogue
with the verdicts kept by `nox -s mutants`, and the hook that puts them into a page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm5_matrix.docs import hooks, tables
from glm5_matrix.files import repo_root
from glm5_matrix.mutants.catalogue import Mutant


def mutant(name: str, ci: bool = False) -> Mutant:
    return Mutant(
        name, Path(f"{name}.patch"), "e2e-cpu", "cpu", "area", "b", "test_a", ("test_a",), ci
    )


def test_cells_table_has_a_row_per_cell_with_its_needs(matrix):
    text = tables.cells_table(matrix)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(matrix.cells)
    e2e_tp2 = next(r for r in rows if r.startswith("| `e2e-tp2`"))
    assert "2 GPUs, compute capability >= 9.0" in e2e_tp2
    assert "`e2e-tp2(deep_gemm)`, `e2e-tp2(flashinfer)`" in e2e_tp2
    pd_cpu = next(r for r in rows if r.startswith("| `pd-nixl-cpu`"))
    assert "CPU (cores 0,1, leased)" in pd_cpu


def test_mutants_table_shows_kept_verdicts_and_says_where_none_is_kept():
    kept = {
        "mutants": [
            {"name": "caught-one", "cell": "e2e-cpu", "status": "caught", "caught_by": ["test_a"]},
            {"name": "survivor", "cell": "e2e-cpu", "status": "survived", "note": "equivalent"},
            {"name": "gone-from-the-catalogue", "cell": "e2e-cpu", "status": "caught"},
        ]
    }
    text = tables.mutants_table(
        [mutant("caught-one", ci=True), mutant("survivor"), mutant("new")], kept
    )
    assert "| `caught-one` (CI) | `e2e-cpu` | area | `test_a` | caught by `test_a` |" in text
    assert "**survived**: equivalent" in text
    assert "no verdict kept here (`nox -s mutants -- --only new`)" in text
    assert "gone-from-the-catalogue" not in text  # a verdict of a mutant no longer catalogued
    assert (
        "3 mutants in the catalogue, 2 with a kept verdict; caught of those judged: **1/2" in text
    )
    assert "survived: `survivor`" in text


def test_mutants_table_without_any_kept_verdict_claims_no_rate():
    text = tables.mutants_table([mutant("a"), mutant("b")], {})
    assert "no verdict is kept in this checkout" in text
    assert "judged" not in text


def test_kept_verdicts_reads_results_json_or_nothing(tmp_path):
    assert tables.kept_verdicts(tmp_path) == {}
    (tmp_path / "results.json").write_text("not json")
    assert tables.kept_verdicts(tmp_path) == {}
    (tmp_path / "results.json").write_text(json.dumps({"mutants": []}))
    assert tables.kept_verdicts(tmp_path) == {"mutants": []}


def test_hook_replaces_each_marker_and_leaves_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM5_MATRIX_MUTANTS_RESULTS", str(tmp_path))  # no kept verdicts
    page = "# Title\n\ntext <!-- table: cells --> inline stays\n\n<!-- table: mutants -->\n"
    out = hooks.on_page_markdown(page, page=None, config=None, files=None)
    assert out.startswith("# Title\n\ntext <!-- table: cells --> inline stays\n")
    assert "| mutant | cell | area | expected catcher | verdict |" in out
    assert "<!-- table: mutants -->" not in out
    with pytest.raises(ValueError, match="no generated table 'nope'"):
        hooks.expand("<!-- table: nope -->")


def test_the_pages_use_the_markers_the_hook_knows():
    docs = repo_root() / "docs"
    assert "<!-- table: cells -->" in (docs / "cells.md").read_text()
    assert "<!-- table: mutants -->" in (docs / "catches.md").read_text()


def test_a_contract_renders_as_its_reference_table(tmp_path):
    text = tables.render("contract-matrix", repo_root(), tmp_path)
    assert text.startswith("| key | type | default | allowed | meaning |")
    assert "| `cells.NAME.gpus` | int | `0` | >= 0 |" in text
    with pytest.raises(ValueError, match="contract-matrix, contract-profile"):
        tables.render("contract-nope", repo_root(), tmp_path)


def test_mutants_table_shows_the_gpu_verdicts_the_repository_keeps():
    """A GPU mutant not run where results-mutants/ was kept shows what GPU runners measured
    (mutants/gpu-verdicts.toml), and counts once, by its latest GPU verdict."""
    from glm5_matrix.results.gpu_verdicts import KeptVerdict

    h100 = KeptVerdict(
        "gpu-one",
        "caught",
        "NVIDIA H100 80GB HBM3",
        "0.33.0",
        "2026-12-06",
        "nox -s mutants",
        "",
        "s",
        ("test_a",),
        72.3,
        76.3,
    )
    h200 = KeptVerdict(
        "gpu-one",
        "survived",
        "NVIDIA H200",
        "0.33.0",
        "2026-12-04",
        "by hand",
        "",
        "s",
    )
    kept = {"mutants": [{"name": "gpu-one", "cell": "e2e-cpu", "status": "not-run"}]}
    text = tables.mutants_table([mutant("gpu-one"), mutant("new")], kept, [h100, h200])
    row = next(line for line in text.splitlines() if line.startswith("| `gpu-one`"))
    assert "NVIDIA H100 80GB HBM3, vLLM 0.33.0, 2026-12-06 (nox -s mutants): caught by" in row
    assert "NVIDIA H200, vLLM 0.33.0, 2026-12-04 (by hand): **survived**" in row
    assert row.index("H100") < row.index("H200")  # newest first
    assert (
        "2 mutants in the catalogue, 1 with a kept verdict; caught of those judged: **1/1" in text
    )


def test_the_checkout_s_gpu_verdicts_reach_the_catches_page(tmp_path):
    text = tables.render("mutants", repo_root(), tmp_path)  # no results-mutants/ here
    assert "| `mamba-v2-hit-state-from-previous-block` |" in text
    assert "NVIDIA H100 80GB HBM3, vLLM 0.33.0, 2026-12-06" in text
