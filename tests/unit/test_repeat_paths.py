"""benchmarks/repeat_paths.py on an outputs.json the real recorder's format holds: per-step noise of
the reference, where each run parts and at what margin, its step-0 move; bad input refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from glm5_matrix.files import repo_root, write_json_atomic
from glm5_matrix.results.recorder import scored_json
from glm5_matrix.verdicts.compare import GreedyOutput

SCRIPT = repo_root() / "benchmarks" / "repeat_paths.py"


def _run(tokens: list[int], step0: dict[int, float], later: float = -1.0) -> GreedyOutput:
    tops = [step0] + [{t: later, 99: later - 0.5} for t in tokens[1:]]
    return GreedyOutput(tokens, [top[t] for t, top in zip(tokens, tops, strict=True)], tops)


def _outputs(path: Path) -> None:
    cold = [
        _run([1, 2, 3], {1: -1.0, 7: -1.3}),
        _run([1, 2, 3], {1: -1.02, 7: -1.3}),
        _run([1, 2, 3], {1: -1.0, 7: -1.31}),
    ]
    repeat = _run([1, 2, 3], {1: -1.1, 7: -1.3})
    stale = _run([1, 5, 3], {1: -1.0, 7: -1.7})
    outputs = {
        "repeat.cold": {"test": "t", "outputs": [scored_json(c) for c in cold]},
        "repeat.repeat": {"test": "t", "outputs": [scored_json(repeat)]},
        "repeat.stale_block": {"test": "t", "outputs": [scored_json(stale)]},
    }
    write_json_atomic(path, {"cell": "c", "complete": True, "outputs": outputs})


def test_paths_against_the_references_own_noise(tmp_path: Path) -> None:
    path = tmp_path / "outputs.json"
    _outputs(path)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    (found,) = json.loads(done.stdout)
    assert found["reference_runs"] == 3
    assert found["noise_per_step"] == [0.02, 0.0, 0.0]
    repeat, stale = found["runs"]["repeat.repeat"], found["runs"]["repeat.stale_block"]
    assert repeat == {
        "shared_tokens": 3,
        "parts_at": None,
        "reference_margin_there": None,
        "step0_delta": 0.1,
    }
    assert stale["shared_tokens"] == 1 and stale["parts_at"] == 1
    assert stale["reference_margin_there"] == 0.5 and stale["step0_delta"] == 0.4


def test_missing_outputs_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "outputs.json"
    _outputs(path)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(path), "--runs", "repeat.other"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "no outputs named ['repeat.other']" in done.stderr
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "absent.json")], capture_output=True, text=True
    )
    assert done.returncode == 2 and "no such file" in done.stderr
