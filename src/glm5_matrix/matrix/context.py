"""The cell context: the one place the suites read a cell's settings from.

The runner writes it as JSON into the cell's results folder and points GLM5_MATRIX_CONTEXT at
it; vLLM's worker processes inherit the variable, so they read the same settings. Running a
suite by hand works too: `GLM5_MATRIX_CELL="e2e-cpu" pytest tests/suites/test_e2e.py` builds
the context from the matrix.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError

CONTEXT_VARIABLE = "GLM5_MATRIX_CONTEXT"
CELL_VARIABLE = "GLM5_MATRIX_CELL"
# The warm step's ledger of configurations warmed (engine_configs.WarmLedger), set by `nox -s warm`.
LEDGER_VARIABLE = "GLM5_MATRIX_WARM_LEDGER"


@dataclass(frozen=True)
class Weights:
    """Which weights a cell uses: a checkpoint directory, or what the profile provides."""

    # "checkpoint"; "random": the profile's config.json with the glm5-random load format;
    # "generated": the profile's own generated model; "dummy": vLLM's dummy weights;
    # "none": the suite reads the config only.
    kind: str
    path: str | None = None
    # Where the choice came from: "profile", "GLM5_PRUNED_MODEL", "MODEL", "--model".
    source: str = "profile"

    def describe(self) -> str:
        if self.kind == "checkpoint":
            return f"checkpoint {self.path} (from {self.source})"
        return {
            "random": "profile config.json with random weights (load format glm5-random)",
            "generated": "the profile's generated model (random weights, fixed seed)",
            "dummy": "profile config.json with vLLM's dummy weights",
            "none": "none: the suite reads the config only",
        }.get(self.kind, self.kind)


@dataclass(frozen=True)
class CellContext:
    cell: str  # the cell's name, e.g. "e2e-tp1"
    id: str  # the session id, e.g. "e2e-tp1(deep_gemm)"
    slug: str  # file-system-safe id, e.g. "e2e-tp1-deep_gemm"
    suite: str
    env: str
    profile: str | None
    tp: int | None
    gpus: int
    settings: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    weights: Weights = field(default_factory=lambda: Weights(kind="dummy"))
    results_dir: str = ""
    vllm: str | None = None  # the vLLM override of this run, if any
    # The kernel guard of this run (GLM5_MATRIX_KERNEL_GUARD, else GLM5_MATRIX_STRICT): kernels
    # compiled after the warm-up fail, and compiled-mode engines run vLLM's jit monitor in error
    # mode. Known failures of that mode only apply with it (known_failures.KnownFailure.guard).
    kernel_guard: bool = False

    def setting(self, name: str, default: Any = None) -> Any:
        return self.settings.get(name, default)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CellContext:
        data = json.loads(text)
        data["weights"] = Weights(**data.get("weights", {"kind": "dummy"}))
        return cls(**data)


def for_variant(variant: Any, **overrides: Any) -> CellContext:
    """The context of a matrix variant (glm5_matrix.matrix.matrix.Variant) before any run-time choice."""
    cell = variant.cell
    values: dict[str, Any] = dict(
        cell=cell.name,
        id=variant.id,
        slug=variant.slug,
        suite=cell.suite,
        env=variant.env,
        profile=cell.profile,
        tp=cell.tp,
        gpus=cell.gpus,
        settings=variant.settings,
        environment=dict(cell.environment),
    )
    values.update(overrides)
    return CellContext(**values)


def current() -> CellContext:
    """The context of the cell this process runs in."""
    path = os.environ.get(CONTEXT_VARIABLE)
    if path:
        try:
            return CellContext.from_json(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(f"{CONTEXT_VARIABLE}={path}: file not found") from None
    cell_id = os.environ.get(CELL_VARIABLE)
    if cell_id:
        from glm5_matrix.files import repo_root
        from glm5_matrix.matrix.matrix import MATRIX_FILE, load_matrix

        variant = load_matrix(repo_root() / MATRIX_FILE).variant(cell_id)
        return for_variant(variant)
    raise UserError(
        f"no cell context: run the suites through nox (`nox -s CELL`), or set {CELL_VARIABLE}"
    )
