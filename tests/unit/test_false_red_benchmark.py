"""benchmarks/false_red.py on results the real judging recorded (synthetic greedy runs, judged by
glm5_matrix.verdicts.judging, figures as the recorder keeps them): pooled per device and
comparison, the judged run against its tolerance, and --check failing where repeated runs prove
a share broken."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from scored_data import DECISIVE, greedy, model_logits, nudged

from glm5_matrix.files import repo_root, write_json_atomic
from glm5_matrix.matrix.tolerances import Tolerances
from glm5_matrix.results import recorder
from glm5_matrix.verdicts import judging

SCRIPT = repo_root() / "benchmarks" / "false_red.py"
TOLERANCES = Tolerances(
    min_distinct_tokens=4,
    min_median_margin_steps=12,
    reference_repeats=30,
    min_power=2.0,
    false_red_per_cell=0.01,
    comparisons_per_cell=10,
)


@pytest.fixture(autouse=True)
def own_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The synthetic cell runs record into a state of their own, and the unit cell's recorder
    and device are put back after each test: left behind, their figures landed in the unit
    cell's results.json and the report drew them as a measured comparison."""
    monkeypatch.setattr(recorder, "_STATE", recorder._State())
    monkeypatch.setattr(judging, "_DEVICE", {})


def _cell_run(folder: Path, outliers: tuple[int, ...], device: str) -> None:
    """One run of an offload-like cell: 30 reference runs (some far out), a judged warm run."""
    recorder._STATE = recorder._State()
    judging.set_device(device)
    logits = model_logits(1, lead=DECISIVE)
    runs = [greedy(nudged(logits, k % 2)) for k in range(30 - len(outliers))]
    runs += [greedy(nudged(logits, k)) for k in outliers]
    recorder.record_figure("device.model", device)
    # The prefill step: judged by its logprobs (a whole run is judged by its tokens).
    comparison = judging.prefill_step("offload_repeat", runs, "GPU repeat", TOLERANCES, 2.0**-5)
    outcome = "passed"
    try:
        comparison.agrees(
            judging.first_step(runs[0]),
            judging.first_step(runs[1]),
            ("GPU repeat", "warm from CPU"),
        )
    except AssertionError:
        outcome = "failed"
    figures = [dataclasses.asdict(f) for f in recorder.figures()]
    write_json_atomic(
        folder / "results.json",
        {
            "cell": {"id": "offload-tp1(offloading)"},
            "complete": True,
            "figures": figures,
            "tests": {"t": {"outcome": outcome}},
        },
    )


def _benchmark(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def test_pooled_per_device_and_comparison(tmp_path: Path) -> None:
    for i in range(3):
        _cell_run(tmp_path / f"h100-{i}", (), "NVIDIA H100 80GB HBM3")
    _cell_run(tmp_path / "h200", (), "NVIDIA H200")
    done = _benchmark(str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "device: NVIDIA H100 80GB HBM3" in done.stdout and "device: NVIDIA H200" in done.stdout
    assert "offload-tp1(offloading): 3 cell run(s), 0 failed" in done.stdout
    assert "offload_repeat [agreement]: 3 run(s), leave-one-out 0/2610" in done.stdout
    assert "outlying runs 0/90" in done.stdout
    pooled = json.loads(_benchmark(str(tmp_path), "--json").stdout)
    found = pooled["NVIDIA H100 80GB HBM3"]["offload-tp1(offloading)"]["comparisons"]
    assert found["offload_repeat [agreement]"]["judged"] == 3 * 870


def test_check_fails_where_repeated_runs_prove_a_share_broken(tmp_path: Path) -> None:
    """Every run holds one far run (one in 30): one run cannot prove it, five pooled can."""
    _cell_run(tmp_path / "one", (40,), "NVIDIA H100 80GB HBM3")
    assert _benchmark(str(tmp_path), "--check").returncode == 0
    for i in range(5):
        _cell_run(tmp_path / f"more-{i}", (40,), "NVIDIA H100 80GB HBM3")
    done = _benchmark(str(tmp_path), "--check")
    assert done.returncode == 1
    assert "PROVEN OVER ITS SHARE" in done.stdout and "add reference runs" in done.stdout


def test_bad_input(tmp_path: Path) -> None:
    done = _benchmark(str(tmp_path / "missing"))
    assert done.returncode != 0 and "neither a results folder" in done.stderr
    with pytest.raises(AssertionError):
        assert _benchmark(str(tmp_path)).returncode == 0
