"""CI pipelines generated from the matrix: a Buildkite pipeline and a GitHub Actions workflow.

Both come from the same data (matrix.toml): one job per cell variant, on an agent or runner
chosen by the cell's needs (a CPU machine, or N GPUs of compute capability >= X), strict on GPU
machines (GLM5_MATRIX_STRICT=1: missing hardware fails instead of skipping), its results/
folder kept as an artifact, the cell's timeout, and a report job after the others. The vLLM
paths a cell guards select it on a change (Buildkite: each step's if_changed; GitHub: the
session list job filters through glm5_matrix.matrix.guards).

    glm5-matrix pipeline buildkite [--output FILE]          (nox -s pipeline -- buildkite)
    glm5-matrix pipeline github [--output FILE]             (nox -s pipeline -- github)
    glm5-matrix pipeline github-matrix SESSIONS.json [--changed PATHS] [--gpu true|false]
                                                            (inside the workflow)
    glm5-matrix pipeline check      both against their schemas, the workflow through actionlint

Agents and runners are expected to say what they have: a Buildkite GPU agent
`queue=gpu gpus=N sm90=true` (sm90 when its GPUs are compute capability 9.0 or newer; an SM100
agent sets sm90 and sm100), a CPU agent `queue=cpu`, each agent 3.109.0 or newer with uv on its
PATH; a GitHub self-hosted GPU runner the labels `gpu`, `gpus-N`, `sm90`. The workflow runs the
CPU cells on a push to main and on a pull request, the GPU cells too on a schedule, by hand
(workflow_dispatch) and on a pull request labelled `gpu` from a branch of the repository itself.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic
from glm5_matrix.matrix.matrix import MATRIX_FILE, Matrix, Variant, load_matrix
from glm5_matrix.matrix.profiles import profile_chain

KINDS = ("buildkite", "github")
CPU_QUEUE = "cpu"
GPU_QUEUE = "gpu"
GITHUB_CPU_RUNNER = "ubuntu-latest"
PYTHON = "3.11"
REPORT_TIMEOUT_MINUTES = 15
HEADER = """\
# Generated from matrix.toml by `nox -s pipeline -- {kind}`: edit matrix.toml, not this file.
"""
# `if_changed` as an object (include/exclude) needs this agent; --changed-files-path needs 3.115.0.
BUILDKITE_AGENT = "3.109.0"
BUILDKITE_HEADER = f"""\
# Upload it from a bootstrap step:
#   nox -s pipeline -- buildkite --output .buildkite/matrix.yml
#   buildkite-agent pipeline upload .buildkite/matrix.yml
# Needs Buildkite agent {BUILDKITE_AGENT} or newer (if_changed with include patterns) and uv on
# every agent's PATH (each step runs nox with `uvx --python {PYTHON}`); agents tagged
# queue=cpu, or queue=gpu gpus=N sm90=true (sm90: compute capability 9.0 or newer).
# Each cell step's if_changed lists what the cell depends on: the harness files it reads and the
# vLLM source paths it guards. The agent skips a step whose patterns match no changed file of the
# build; for a vLLM change, list its files for the agent (`--changed-files-path FILE`, agent
# 3.115.0); to run every cell (a scheduled run against a new vLLM), upload with
# `--apply-if-changed=false`.
"""


# --- what a cell needs --------------------------------------------------------------------------


def capability_tag(variant: Variant) -> str | None:
    """ "sm90" for a cell that needs compute capability >= 9.0 (the matrix's own tag)."""
    if variant.cell.min_compute_capability is None:
        return None
    major, minor = variant.cell.min_compute_capability
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


# What nox reads before any session starts: the noxfile, the matrix and every environment
# definition (runner.load checks the matrix against envs/), the package, the project's tool
# settings (pytest, ruff, mypy).
NOX_READS = ("noxfile.py", "matrix.toml", "envs/*.toml", "pyproject.toml", "src/glm5_matrix/**")
# What every pytest cell loads besides its tests: the known-failures plugin's registry.
PYTEST_READS = ("known-failures.toml",)


def harness_paths(matrix: Matrix, variant: Variant) -> list[str]:
    """This repository's files a cell's outcome depends on (Buildkite and GitHub glob syntax),
    derived from what it reads: what nox reads, its environment's constraints, its profile, its
    tests and the conftest.py files above them, what its tests read besides (`reads`), and all of
    that for each cell it runs (`runs`)."""
    cell = variant.cell
    paths = [*NOX_READS, f"constraints/{variant.env}.txt"]
    root = matrix.source.parent
    if cell.profile:  # and the profile it extends
        paths += [f"profiles/{name}/**" for name in profile_chain(cell.profile, root)]
    if cell.tests:
        paths += PYTEST_READS
    for test in cell.tests:
        test = test.split("::")[0]
        paths.append(test if test.endswith(".py") else f"{test.rstrip('/')}/**")
        paths += _conftests(root, test)
    paths += cell.reads
    for name in cell.runs:
        for ran in matrix.cell(name).variants:
            paths += harness_paths(matrix, ran)
    return list(dict.fromkeys(paths))


def _conftests(root: Path, test: str) -> list[str]:
    """The conftest.py files pytest loads for `test` from the folders above it (those inside a
    folder of tests are in its own pattern)."""
    parents = Path(test).parents
    found = [
        folder / "conftest.py" for folder in parents if (root / folder / "conftest.py").is_file()
    ]
    return [path.as_posix() for path in reversed(found)]


def guard_globs(variant: Variant) -> list[str]:
    return [f"{guard}**" if guard.endswith("/") else guard for guard in variant.guards]


# Each CI command runs nox through uv on the Python the harness needs (uv fetches it where the
# machine has none): no install into the agent's own Python, which Debian marks as externally
# managed and which may be older than the harness's 3.11.
NOX = f"uvx --python {PYTHON} --from 'nox>=2026.8' nox"


def _nox(session: str) -> str:
    return f"{NOX} -s {shlex.quote(session)}"


# --- Buildkite ----------------------------------------------------------------------------------


def buildkite(matrix: Matrix) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    for variant in matrix.variants:
        step: dict[str, Any] = {
            "label": variant.id,
            "key": f"cell-{variant.slug}",
            "command": _nox(variant.id),
            "agents": agent_query(variant),
        }
        if strict(variant):
            step["env"] = {"GLM5_MATRIX_STRICT": "1"}
        step.update(
            {
                "timeout_in_minutes": variant.cell.timeout_minutes,
                "artifact_paths": [f"results/{variant.slug}/**/*"],
                "if_changed": {"include": harness_paths(matrix, variant) + guard_globs(variant)},
            }
        )
        steps.append(step)
    # A wait, not depends_on: a step if_changed left out is not in the build, and the report
    # step must still run after whatever is (and whether it passed).
    steps.append({"wait": None, "continue_on_failure": True})
    steps.append(
        {
            "label": "report",
            "key": "report",
            "commands": [
                'buildkite-agent artifact download "results/**/*" . || true',
                "mkdir -p results",  # no cell left results: the report says every one not run
                _nox("report"),
                "buildkite-agent annotate --style info --context glm5-matrix "
                "< results/report/report.md",
            ],
            "agents": {"queue": CPU_QUEUE},
            "timeout_in_minutes": REPORT_TIMEOUT_MINUTES,
            "artifact_paths": ["results/report/*"],
        }
    )
    return {"steps": steps}


# --- GitHub Actions -----------------------------------------------------------------------------

WORKFLOW_FILE = ".github/workflows/glm5-matrix.yml"
GPU_LABEL = "gpu"
SCHEDULE = "17 3 * * *"  # nightly, every cell
# GPU cells run on a schedule, on demand, and on a pull request labelled `gpu` whose branch is in
# this repository: a fork's code never reaches the self-hosted GPU runners.
GPU_CELLS = (
    "${{ github.event_name == 'schedule' "
    "|| (github.event_name == 'workflow_dispatch' && inputs.gpu) "
    "|| (github.event_name == 'pull_request' "
    "&& github.event.pull_request.head.repo.full_name == github.repository "
    f"&& contains(github.event.pull_request.labels.*.name, '{GPU_LABEL}')) }}}}"
)


def _setup_steps() -> list[dict[str, Any]]:
    return [
        {"uses": "actions/checkout@v4"},
        {"uses": "actions/setup-python@v5", "with": {"python-version": PYTHON}},
        {"run": "python -m pip install 'nox>=2026.8' uv"},
    ]


def workflow_paths(matrix: Matrix) -> list[str]:
    """What a push or pull request must touch to run the workflow: every cell's harness files
    and the workflow itself."""
    paths = [path for variant in matrix.variants for path in harness_paths(matrix, variant)]
    return list(dict.fromkeys([*paths, WORKFLOW_FILE]))


def github(matrix: Matrix) -> dict[str, Any]:
    """The workflow. Its matrix is not written here: a first job lists the sessions with
    `nox -l --json` (nox's cookbook way), so the workflow holds no cell and never goes stale;
    this module only turns that list into matrix entries (github_matrix)."""
    listing = (
        "nox -l --json > sessions.json\n"
        "PYTHONPATH=src python -m glm5_matrix.cli pipeline github-matrix sessions.json "
        '--changed "$VLLM_CHANGES" --gpu "$GPU_CELLS" --github-output "$GITHUB_OUTPUT"'
    )
    paths = workflow_paths(matrix)
    return {
        "name": "glm5-matrix",
        "on": {
            # Pushes to main only: a pull request's branch runs once, as the pull request.
            "push": {"branches": ["main"], "paths": paths},
            "pull_request": {
                "types": ["opened", "synchronize", "reopened", "labeled"],
                "paths": paths,
            },
            "schedule": [{"cron": SCHEDULE}],
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
                    "gpu": {
                        "description": "run the GPU cells too (self-hosted GPU runners)",
                        "required": False,
                        "default": True,
                        "type": "boolean",
                    },
                }
            },
        },
        "permissions": {"contents": "read"},
        # One run per pull request (or branch): a new push cancels the pull request's older run.
        "concurrency": {
            "group": "${{ github.workflow }}-${{ github.event.pull_request.number || github.ref }}",
            "cancel-in-progress": "${{ github.event_name == 'pull_request' }}",
        },
        "jobs": {
            "sessions": {
                # A label other than `gpu` changes nothing: no new run.
                "if": f"github.event.action != 'labeled' || github.event.label.name == '{GPU_LABEL}'",
                "runs-on": GITHUB_CPU_RUNNER,
                "outputs": {"matrix": "${{ steps.list.outputs.matrix }}"},
                "steps": [
                    *_setup_steps(),
                    {
                        "id": "list",
                        "env": {
                            "VLLM_CHANGES": "${{ inputs.vllm_changes }}",
                            "GPU_CELLS": GPU_CELLS,
                        },
                        "run": listing,
                    },
                ],
            },
            "cell": {
                "needs": "sessions",
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
                "if": "${{ always() && needs.sessions.result != 'skipped' }}",
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
    matrix: Matrix,
    sessions: list[dict[str, Any]],
    changed: list[str] | None = None,
    gpu: bool = True,
) -> list[dict[str, Any]]:
    """Matrix entries from `nox -l --json`: every cell session (not the meta ones), with the
    runner labels and timeout of its cell; only those guarding `changed` when it is given, and
    no GPU cell unless `gpu`. A selection that leaves nothing to run is a UserError that says
    why: a run that tests nothing must not pass."""
    wanted: set[str] | None = None
    if changed:
        from glm5_matrix.matrix.guards import affected, unguarded

        wanted = {a.variant.id for a in affected(matrix, changed)}
        if not wanted:
            paths = " ".join(unguarded(matrix, changed))
            raise UserError(
                f"no cell guards {paths}: nothing would run (a path of another vLLM version? "
                "`glm5-matrix affected` matches paths against each cell's guards)"
            )
    entries = []
    for listed in sessions:
        if "meta" in (listed.get("tags") or []):
            continue
        variant = matrix.variant(str(listed["session"]))
        if wanted is not None and variant.id not in wanted:
            continue
        if variant.cell.gpus and not gpu:
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
    if not entries:
        reason = "only GPU cells guard these paths" if wanted else "the list has no cell"
        raise UserError(f"nothing to run: {reason}, and GPU cells are off for this run")
    return entries


# --- output -------------------------------------------------------------------------------------


def render(kind: str, matrix: Matrix) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (a job's script) as literal blocks, as a person writes them; a list
        used twice written out twice, not as a YAML alias."""

        def ignore_aliases(self, data: Any) -> bool:
            return True

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
    _check_output(output, "--output")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, text)
    print(f"wrote {output}", file=sys.stderr)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pipeline",
        help="CI pipelines from the matrix: a Buildkite pipeline, a GitHub Actions workflow",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("kind", choices=("buildkite", "github", "github-matrix", "check"))
    parser.add_argument("sessions", nargs="?", type=Path, help="github-matrix: nox -l --json")
    parser.add_argument("--output", type=Path, help="write here (atomically) instead of stdout")
    parser.add_argument("--matrix", type=Path, help="the matrix file (default: the checkout's)")
    parser.add_argument("--changed", default="", help="github-matrix: changed vLLM paths")
    parser.add_argument(
        "--gpu",
        choices=("true", "false"),
        default="true",
        help="github-matrix: include the GPU cells (default true)",
    )
    parser.add_argument("--github-output", type=Path, help="github-matrix: append matrix=")
    parser.set_defaults(func=_run, preflight=_preflight)


def _check_output(path: Path, flag: str) -> None:
    if path.is_dir():
        raise UserError(f"{path}: a folder ({flag} names the file to write)")


def _sessions(path: Path | None) -> list[Any]:
    """The session list `nox -l --json` wrote, or a UserError."""
    if path is None:
        raise UserError("github-matrix needs the file `nox -l --json` wrote")
    try:
        sessions = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not nox's session list: {exc}") from None
    if not isinstance(sessions, list):
        raise UserError(f"{path}: not nox's session list: not a JSON list")
    return sessions


def _preflight(args: argparse.Namespace) -> Matrix:
    """The inputs checked before anything is written (and, under `nox -s pipeline`, before the
    harness environment is built): the matrix, the session list, where to write."""
    from glm5_matrix.files import repo_root

    matrix = load_matrix(args.matrix or repo_root() / MATRIX_FILE)
    if args.kind == "github-matrix":
        _sessions(args.sessions)
    for path, flag in ((args.output, "--output"), (args.github_output, "--github-output")):
        if path is not None:
            _check_output(path, flag)
    return matrix


def _run(args: argparse.Namespace) -> int:
    matrix = _preflight(args)
    if args.kind == "check":
        from glm5_matrix.pipelines import checks

        failures = checks.check({kind: render(kind, matrix) for kind in KINDS})
        for failure in failures:
            print(f"glm5-matrix pipeline check: {failure}", file=sys.stderr)
        return 1 if failures else 0
    if args.kind != "github-matrix":
        _write(render(args.kind, matrix), args.output)
        return 0
    sessions = _sessions(args.sessions)
    changed = args.changed.split()
    gpu = args.gpu == "true"
    entries = github_matrix(matrix, sessions, changed, gpu=gpu)
    from glm5_matrix.matrix.guards import unguarded

    for path in unguarded(matrix, changed) if changed else []:
        print(f"no cell guards {path}", file=sys.stderr)
    if not gpu:
        print("GPU cells are off for this run", file=sys.stderr)
    print(
        f"running {len(entries)} cells: {' '.join(e['session'] for e in entries)}", file=sys.stderr
    )
    text = json.dumps({"include": entries}, separators=(",", ":"))
    if args.github_output is not None:
        with args.github_output.open("a") as out:
            out.write(f"matrix={text}\n")
    _write(text + "\n", args.output)
    return 0
