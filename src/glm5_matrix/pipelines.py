"""CI pipelines generated from the matrix: a Buildkite pipeline and a GitHub Actions workflow.

Both come from the same data (matrix.toml): one job per cell variant, on an agent or runner
chosen by the cell's needs (a CPU machine, or N GPUs of compute capability >= X), strict on GPU
machines (GLM5_MATRIX_STRICT=1: missing hardware fails instead of skipping), its results/
folder kept as an artifact, the cell's timeout, and a report job after the others. The vLLM
paths a cell guards select it on a change (Buildkite: each step's if_changed; GitHub: the
session list job filters through glm5_matrix.guards).

    glm5-matrix pipeline buildkite [--output FILE]          (nox -s pipeline -- buildkite)
    glm5-matrix pipeline github [--output FILE]             (nox -s pipeline -- github)
    glm5-matrix pipeline github-matrix SESSIONS.json [--changed PATHS]   (inside the workflow)

Agents and runners are expected to say what they have: a Buildkite GPU agent
`queue=gpu gpus=N sm90=true` (sm90 when its GPUs are compute capability 9.0 or newer; an SM100
agent sets sm90 and sm100), a CPU agent `queue=cpu`; a GitHub self-hosted GPU runner the labels
`gpu`, `gpus-N`, `sm90`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.matrix import MATRIX_FILE, Matrix, Variant, load_matrix, parse_compute_capability

CPU_QUEUE = "cpu"
GPU_QUEUE = "gpu"
GITHUB_CPU_RUNNER = "ubuntu-latest"
PYTHON = "3.11"
REPORT_TIMEOUT_MINUTES = 15
HEADER = """\
# Generated from matrix.toml by `nox -s pipeline -- {kind}`: edit matrix.toml, not this file.
"""
BUILDKITE_HEADER = """\
# Upload it from a bootstrap step:
#   nox -s pipeline -- buildkite --output .buildkite/matrix.yml
#   buildkite-agent pipeline upload .buildkite/matrix.yml
# Each cell step's if_changed lists what the cell depends on: the harness files it runs and the
# vLLM source paths it guards. The agent (3.103 or newer) skips a step whose patterns match no
# changed file of the build; for a vLLM change, list its files for the agent
# (`--changed-files-path FILE`, agent 3.115); to run every cell (a scheduled run against a new
# vLLM), upload with `--apply-if-changed=false`.
"""


# --- what a cell needs --------------------------------------------------------------------------


def capability_tag(variant: Variant) -> str | None:
    """ "sm90" for a cell that needs compute capability >= 9.0 (the matrix's own tag)."""
    if variant.cell.min_compute_capability is None:
        return None
    major, minor = parse_compute_capability(variant.cell.min_compute_capability)
    return f"sm{major}{minor}"


def agent_query(variant: Variant) -> dict[str, str]:
    """Buildkite agent tags the step asks for."""
    if not variant.cell.gpus:
        return {"queue": CPU_QUEUE}
    query = {"queue": GPU_QUEUE, "gpus": str(variant.cell.gpus)}
    tag = capability_tag(variant)
    if tag:
        query[tag] = "true"
    return query


def runner_labels(variant: Variant) -> str | list[str]:
    """GitHub runs-on: a hosted runner for CPU cells, labels of a self-hosted GPU runner."""
    if not variant.cell.gpus:
        return GITHUB_CPU_RUNNER
    labels = ["self-hosted", "linux", "gpu", f"gpus-{variant.cell.gpus}"]
    tag = capability_tag(variant)
    return labels + ([tag] if tag else [])


def strict(variant: Variant) -> bool:
    return bool(variant.cell.gpus)


def harness_paths(variant: Variant) -> list[str]:
    """This repository's files a cell's outcome depends on (Buildkite glob syntax)."""
    cell = variant.cell
    paths = ["matrix.toml", "noxfile.py", "pyproject.toml", "src/**"]
    paths += [f"envs/{variant.env}.toml", f"constraints/{variant.env}.txt"]
    if cell.profile:
        paths.append(f"profiles/{cell.profile}/**")
    for test in cell.tests:
        paths.append(test if test.endswith(".py") else f"{test.rstrip('/')}/**")
        if test.startswith("tests/suites/"):
            paths += ["tests/suites/conftest.py", "known-failures.toml"]
    if cell.commands:  # lint: every Python file
        paths.append("**.py")
    return list(dict.fromkeys(paths))


def guard_globs(variant: Variant) -> list[str]:
    return [f"{guard}**" if guard.endswith("/") else guard for guard in variant.guards]


def _nox(session: str) -> str:
    return f"python3 -m nox -s {shlex.quote(session)}"


# --- Buildkite ----------------------------------------------------------------------------------


def buildkite(matrix: Matrix) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    for variant in matrix.variants:
        env = {"GLM5_MATRIX_TAGS": " ".join(variant.tags)}
        if strict(variant):
            env["GLM5_MATRIX_STRICT"] = "1"
        steps.append(
            {
                "label": variant.id,
                "key": f"cell-{variant.slug}",
                "command": f"python3 -m pip install 'nox>=2026.8' uv && {_nox(variant.id)}",
                "agents": agent_query(variant),
                "env": env,
                "timeout_in_minutes": variant.cell.timeout_minutes,
                "artifact_paths": [f"results/{variant.slug}/**/*"],
                "if_changed": {"include": harness_paths(variant) + guard_globs(variant)},
            }
        )
    # A wait, not depends_on: a step if_changed left out is not in the build, and the report
    # step must still run after whatever is (and whether it passed).
    steps.append({"wait": None, "continue_on_failure": True})
    steps.append(
        {
            "label": "report",
            "key": "report",
            "commands": [
                "python3 -m pip install 'nox>=2026.8' uv",
                'buildkite-agent artifact download "results/**/*" . || true',
                "mkdir -p results",  # no cell left results: the report says every one not run
                "python3 -m nox -s report",
                "buildkite-agent annotate --style info --context glm5-matrix "
                "< results/report/report.md",
            ],
            "agents": {"queue": CPU_QUEUE},
            "timeout_in_minutes": REPORT_TIMEOUT_MINUTES,
            "artifact_paths": ["results/report/*"],
        }
    )
    return {"env": {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}, "steps": steps}


# --- GitHub Actions -----------------------------------------------------------------------------


def _setup_steps() -> list[dict[str, Any]]:
    return [
        {"uses": "actions/checkout@v4"},
        {"uses": "actions/setup-python@v5", "with": {"python-version": PYTHON}},
        {"run": "python -m pip install 'nox>=2026.8' uv"},
    ]


def github(matrix: Matrix) -> dict[str, Any]:
    """The workflow. Its matrix is not written here: a first job lists the sessions with
    `nox -l --json` (nox's cookbook way), so the workflow holds no cell and never goes stale;
    this module only turns that list into matrix entries (github_matrix)."""
    listing = (
        "nox -l --json > sessions.json\n"
        "PYTHONPATH=src python -m glm5_matrix.cli pipeline github-matrix sessions.json "
        '--changed "$VLLM_CHANGES" --github-output "$GITHUB_OUTPUT"'
    )
    return {
        "name": "glm5-matrix",
        "on": {
            "push": None,
            "pull_request": None,
            "workflow_dispatch": {
                "inputs": {
                    "vllm": {
                        "description": "vLLM to test: a version (empty: each environment's pin)",
                        "required": False,
                        "default": "",
                        "type": "string",
                    },
                    "vllm_changes": {
                        "description": "vLLM source paths a change touches, space-separated: "
                        "only the cells guarding them run (empty: every cell)",
                        "required": False,
                        "default": "",
                        "type": "string",
                    },
                }
            },
        },
        "jobs": {
            "sessions": {
                "runs-on": GITHUB_CPU_RUNNER,
                "outputs": {
                    "matrix": "${{ steps.list.outputs.matrix }}",
                    "any": "${{ steps.list.outputs.any }}",
                },
                "steps": [
                    *_setup_steps(),
                    {
                        "id": "list",
                        "env": {"VLLM_CHANGES": "${{ inputs.vllm_changes }}"},
                        "run": listing,
                    },
                ],
            },
            "cell": {
                "needs": "sessions",
                "if": "${{ needs.sessions.outputs.any == 'true' }}",
                "name": "${{ matrix.session }}",
                "runs-on": "${{ matrix.runs-on }}",
                "timeout-minutes": "${{ matrix.timeout }}",
                "strategy": {
                    "fail-fast": False,
                    "matrix": "${{ fromJSON(needs.sessions.outputs.matrix) }}",
                },
                "env": {
                    "GLM5_MATRIX_STRICT": "${{ matrix.strict }}",
                    "GLM5_MATRIX_VLLM": "${{ inputs.vllm }}",
                },
                "steps": [
                    *_setup_steps(),
                    {"run": 'nox -s "${{ matrix.session }}"'},
                    {
                        "if": "always()",
                        "uses": "actions/upload-artifact@v4",
                        "with": {
                            "name": "${{ matrix.slug }}",
                            "path": "results/${{ matrix.slug }}/",
                            "if-no-files-found": "ignore",
                        },
                    },
                ],
            },
            "report": {
                "needs": ["sessions", "cell"],
                "if": "${{ always() }}",
                "runs-on": GITHUB_CPU_RUNNER,
                "timeout-minutes": REPORT_TIMEOUT_MINUTES,
                "steps": [
                    *_setup_steps(),
                    # Each cell's artifact lands in results/<its slug>/.
                    {"uses": "actions/download-artifact@v4", "with": {"path": "results"}},
                    {"run": "mkdir -p results && nox -s report"},
                    {
                        "if": "always()",
                        "run": 'cat results/report/report.md >> "$GITHUB_STEP_SUMMARY"',
                    },
                    {
                        "if": "always()",
                        "uses": "actions/upload-artifact@v4",
                        "with": {"name": "report", "path": "results/report/"},
                    },
                ],
            },
        },
    }


def github_matrix(
    matrix: Matrix, sessions: list[dict[str, Any]], changed: list[str] | None = None
) -> list[dict[str, Any]]:
    """Matrix entries from `nox -l --json`: every cell session (not the meta ones), with the
    runner labels and timeout of its cell; only those guarding `changed` when it is given."""
    wanted: set[str] | None = None
    if changed:
        from glm5_matrix.guards import affected

        wanted = {a.variant.id for a in affected(matrix, changed)}
    entries = []
    for listed in sessions:
        if "meta" in (listed.get("tags") or []):
            continue
        variant = matrix.variant(str(listed["session"]))
        if wanted is not None and variant.id not in wanted:
            continue
        entries.append(
            {
                "session": variant.id,
                "slug": variant.slug,
                "tags": listed.get("tags") or variant.tags,
                "runs-on": runner_labels(variant),
                "timeout": variant.cell.timeout_minutes,
                "strict": "1" if strict(variant) else "",
            }
        )
    return entries


# --- output -------------------------------------------------------------------------------------


def render(kind: str, matrix: Matrix) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (a job's script) as literal blocks, as a person writes them."""

    def string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, string)
    data = buildkite(matrix) if kind == "buildkite" else github(matrix)
    text = yaml.dump(data, Dumper=Dumper, sort_keys=False, width=100, default_flow_style=False)
    if kind == "github":
        # PyYAML writes the `on` key quoted ('on'), which GitHub reads the same.
        text = text.replace("'on':", "on:", 1)
    header = HEADER.format(kind=kind) + (BUILDKITE_HEADER if kind == "buildkite" else "")
    return header + text


def _write(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, output)
    print(f"wrote {output}", file=sys.stderr)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pipeline",
        help="CI pipelines from the matrix: a Buildkite pipeline, a GitHub Actions workflow",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("kind", choices=("buildkite", "github", "github-matrix"))
    parser.add_argument("sessions", nargs="?", type=Path, help="github-matrix: nox -l --json")
    parser.add_argument("--output", type=Path, help="write here (atomically) instead of stdout")
    parser.add_argument("--matrix", type=Path, help="the matrix file (default: the checkout's)")
    parser.add_argument("--changed", default="", help="github-matrix: changed vLLM paths")
    parser.add_argument("--github-output", type=Path, help="github-matrix: append matrix= and any=")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from glm5_matrix.profiles import repo_root

    matrix = load_matrix(args.matrix or repo_root() / MATRIX_FILE)
    if args.kind != "github-matrix":
        _write(render(args.kind, matrix), args.output)
        return 0
    if args.sessions is None:
        raise UserError("github-matrix needs the file `nox -l --json` wrote")
    try:
        sessions = json.loads(args.sessions.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{args.sessions}: not nox's session list: {exc}") from None
    entries = github_matrix(matrix, sessions, args.changed.split())
    text = json.dumps({"include": entries}, separators=(",", ":"))
    if args.github_output is not None:
        with args.github_output.open("a") as out:
            out.write(f"matrix={text}\nany={'true' if entries else 'false'}\n")
    _write(text + "\n", args.output)
    return 0
