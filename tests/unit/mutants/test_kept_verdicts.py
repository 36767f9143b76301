"""The GPU half of the catalogue, kept (glm5_matrix.results.gpu_verdicts): the repository's file
loads and names catalogue entries of GPU cells; a bad entry is one line; a GPU run's verdicts are
kept (model, vLLM, date, tests, control wall) and a CPU run writes nothing; the report shows them
(the docs site's table: tests/unit/docs/test_tables.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from scaffold import ROOT

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_json_atomic
from glm5_matrix.mutants import catalogue, record, verdicts
from glm5_matrix.mutants.catalogue import Mutant
from glm5_matrix.mutants.run import Outcome
from glm5_matrix.report import mutants as report
from glm5_matrix.results import gpu_verdicts
from glm5_matrix.results.gpu_verdicts import KeptVerdict
from glm5_matrix.sessions import runner

H100 = "NVIDIA H100 80GB HBM3"


def _kept(mutant: str = "m", gpu: str = H100, status: str = "caught", **more) -> KeptVerdict:
    fields = {
        "mutant": mutant,
        "status": status,
        "gpu": gpu,
        "vllm": "0.33.0",
        "date": "2026-12-06",
        "how": "nox -s mutants",
        "detail": "",
        "source": "results-mutants/runs/m",
        "caught_by": ("test_a",) if status == "caught" else (),
        "seconds": 72.3,
        "control_seconds": 76.3,
    }
    return KeptVerdict(**{**fields, **more})


def test_the_repository_keeps_gpu_verdicts_of_catalogued_gpu_mutants() -> None:
    matrix = runner.load(ROOT)
    cells = {v.id: v.env for v in matrix.variants}
    gpu_cells = {v.id for v in matrix.variants if v.cell.gpus}
    mutants = {m.name: m for m in catalogue.load_catalogue(ROOT / catalogue.CATALOGUE_FILE, cells)}
    kept = gpu_verdicts.load(ROOT / gpu_verdicts.KEPT_FILE)
    assert len(kept) >= 7
    for verdict in kept:
        assert verdict.mutant in mutants, verdict.mutant
        assert mutants[verdict.mutant].cell in gpu_cells, verdict.mutant
    models = {v.gpu for v in kept}
    assert models == {"NVIDIA H200", H100}


def test_round_trip_and_update(tmp_path: Path) -> None:
    path = tmp_path / "kept.toml"
    first = [_kept("a"), _kept("b", status="survived", control_seconds=None)]
    path.write_text(gpu_verdicts.dumps(first))
    assert gpu_verdicts.load(path) == first
    newer = dataclasses.replace(first[0], date="2026-12-07", seconds=60.0)
    other_gpu = _kept("a", gpu="NVIDIA H200")
    merged = gpu_verdicts.updated(first, [newer, other_gpu])
    assert merged == [newer, first[1], other_gpu]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"colour": "red"}, r"verdict #1.colour: unknown key"),
        ({"status": "judged"}, "is not one of"),
        ({"status": "invalid", "caught_by": []}, "says why it judged nothing"),
        ({"date": "6 Dec"}, "must be YYYY-MM-DD"),
        ({"caught_by": []}, "names the tests that caught it"),
        ({"gpu": ""}, "gpu: must not be empty"),
        ({"seconds": "fast"}, "seconds: must be a number"),
    ],
)
def test_a_bad_entry_is_one_line(tmp_path: Path, entry: dict, message: str) -> None:
    good = json.loads(json.dumps(dataclasses.asdict(_kept())))
    path = tmp_path / "kept.toml"
    lines = ["[[verdict]]"] + [
        f"{k} = {json.dumps(v)}" for k, v in {**good, **entry}.items() if v is not None
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=message) as raised:
        gpu_verdicts.load(path)
    assert "\n" not in str(raised.value)


def test_the_same_verdict_kept_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kept.toml"
    path.write_text(gpu_verdicts.dumps([_kept(), _kept()]))
    with pytest.raises(UserError, match="kept twice"):
        gpu_verdicts.load(path)


def _mutant(name: str, cell: str) -> Mutant:
    return Mutant(name, Path("/p"), cell, "cuda", "area", "breaks", "test_a", ("test_a",))


def _outcome(tmp_path: Path, name: str, cell: str, status: str, seconds: float = 80.0) -> Outcome:
    folder = tmp_path / name
    write_json_atomic(folder / "results.json", {"versions": {"vllm": "0.33.0"}})
    caught = ("test_a",) if status == "caught" else ()
    return Outcome(
        _mutant(name, cell), cell, verdicts.Verdict(status, caught, "d"), seconds, str(folder)
    )


def test_a_gpu_run_keeps_its_judged_gpu_verdicts_and_a_cpu_run_none(tmp_path: Path) -> None:
    outcomes = [
        _outcome(tmp_path, "gpu-caught", "offload-tp1(simple)", "caught"),
        _outcome(tmp_path, "gpu-invalid", "offload-tp1(simple)", "invalid"),
        _outcome(tmp_path, "cpu-caught", "e2e-cpu", "caught"),
    ]
    control = Outcome(None, "offload-tp1(simple)", verdicts.Verdict("survived"), 108.3, None)
    gpu_cells = {"offload-tp1(simple)"}
    kept = record.kept_verdicts(outcomes, [control], gpu_cells, H100, "2026-12-07", "nox")
    assert [(k.mutant, k.gpu, k.vllm, k.caught_by, k.control_seconds) for k in kept] == [
        ("gpu-caught", H100, "0.33.0", ("test_a",), 108.3)
    ]
    assert record.kept_verdicts(outcomes, [control], gpu_cells, "cpu: AMD EPYC", "d", "x") == []
    path = tmp_path / "kept.toml"
    path.write_text(gpu_verdicts.dumps([_kept("other")]))
    assert record.keep(path, kept) == path
    assert [v.mutant for v in gpu_verdicts.load(path)] == ["other", "gpu-caught"]
    assert record.keep(path, []) is None


def test_the_report_shows_kept_verdicts_where_a_gpu_row_was_not_run_here() -> None:
    rows = [
        {
            "name": "m",
            "cell": "offload-tp1(simple)",
            "area": "a",
            "breaks": "b",
            "status": "not-run",
            "detail": "needs 1 GPU",
        }
    ]
    kept = [_kept("m"), _kept("m", gpu="NVIDIA H200", date="2026-12-04", status="survived")]
    text = report.render({"mutants": rows, "summary": {"overall": "0/0"}}, kept)
    assert f"{H100}, vLLM 0.33.0, 2026-12-06 (nox -s mutants): caught by `test_a`" in text
    assert "NVIDIA H200, vLLM 0.33.0, 2026-12-04 (nox -s mutants): **survived**" in text
    assert f"- {H100}: 1 of 1 judged caught" in text
    assert "- NVIDIA H200: 0 of 1 judged caught" in text


def test_a_run_that_judged_nothing_is_kept_as_such_and_counted_apart() -> None:
    """A mutant whose control failed on the GPU (its verdict rule's own false red on the H100):
    kept by hand as invalid, with why; shown as not judged, counted neither caught nor
    survived, and a judged verdict of another GPU is not hidden by it."""
    invalid = _kept(
        "m", status="invalid", date="2026-12-07", detail="not judged: its control failed"
    )
    assert not invalid.judged and "not judged (not judged: its control failed)" in (
        invalid.describe()
    )
    rows = [{"name": "m", "cell": "c", "area": "a", "breaks": "b", "status": "not-run"}]
    kept = [invalid, _kept("m", gpu="NVIDIA H200", date="2026-12-04")]
    text = report.render({"mutants": rows, "summary": {"overall": "0/0"}}, kept)
    assert f"- {H100}: 0 of 0 judged caught, 1 not judged" in text
    assert "- NVIDIA H200: 1 of 1 judged caught" in text
