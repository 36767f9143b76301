"""The matrix: cells read from matrix.toml, validated, expanded over their axis, tagged.

A cell is one named nox session; its optional axis (MoE backend, KV connector, environment)
turns it into one parametrized session per value. Everything a session needs is here as data;
the noxfile only registers what this module returns. So are what a CI system needs to schedule
it (its timeout) and the vLLM source paths it guards (a change there should run it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError, load_toml

MATRIX_FILE = "matrix.toml"
SUITES = ("e2e", "offload", "pd", "dflash", "noise", "layout", "metadata", "unit", "lint", "faults")
# Suites whose cells start engines or servers (the others have nothing to warm).
ENGINE_SUITES = ("e2e", "offload", "dflash", "pd", "noise")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_VALUE = re.compile(r"^[A-Za-z0-9_.-]+$")
# A vLLM source path, relative to the root of vLLM's repository: a file, or a folder ending in /.
_GUARD = re.compile(r"^vllm/(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]*$")
# A cell that gives no timeout gets this one (minutes): what a CI step is allowed.
DEFAULT_TIMEOUT_MINUTES = 60
_CELL_FIELDS = {
    "description": str,
    "suite": str,
    "env": str,
    "tests": list,
    "commands": list,
    "profile": str,
    "gpus": int,
    "cores": list,
    "min_compute_capability": str,
    "tp": int,
    "settings": dict,
    "environment": dict,
    "axis": dict,
    "timeout_minutes": int,
    "guard_sets": list,
    "guards": list,
    "axis_guards": dict,
    "runs": list,
    "reads": list,
}
_AXIS_FIELDS = {"name": str, "values": list, "tag_prefix": str}


@dataclass(frozen=True)
class Axis:
    name: str
    values: tuple[str, ...]
    tag_prefix: str


@dataclass(frozen=True)
class Variant:
    """One runnable point of the matrix: a cell, with its axis value fixed when it has one."""

    cell: Cell
    value: str | None = None

    @property
    def id(self) -> str:
        """The nox session name: `e2e-tp1(deep_gemm)`, or just `unit`."""
        return f"{self.cell.name}({self.value})" if self.value is not None else self.cell.name

    @property
    def slug(self) -> str:
        """A file-system-safe id for result and environment folders."""
        return f"{self.cell.name}-{self.value}" if self.value is not None else self.cell.name

    @property
    def env(self) -> str:
        if self.cell.axis is not None and self.cell.axis.name == "env":
            assert self.value is not None
            return self.value
        assert self.cell.env is not None
        return self.cell.env

    @property
    def settings(self) -> dict[str, Any]:
        """What the suites read: the cell's settings plus the axis value under its name."""
        merged: dict[str, Any] = dict(self.cell.settings)
        if self.cell.axis is not None and self.value is not None:
            merged[self.cell.axis.name] = self.value
        return merged

    @property
    def tags(self) -> list[str]:
        tags = list(self.cell.base_tags)
        tags.append(f"env-{self.env}")
        if self.cell.axis is not None and self.value is not None:
            tags.append(f"{self.cell.axis.tag_prefix}-{self.value}")
        return sorted(set(tags))

    @property
    def guards(self) -> tuple[str, ...]:
        """The vLLM source paths this variant guards: the cell's, then its axis value's."""
        extra = self.cell.axis_guards.get(self.value, ()) if self.value is not None else ()
        return (*self.cell.guards, *extra)


@dataclass(frozen=True)
class Cell:
    name: str
    description: str
    suite: str
    env: str | None = None
    tests: tuple[str, ...] = ()
    commands: tuple[tuple[str, ...], ...] = ()
    profile: str | None = None
    gpus: int = 0
    # The CPU cores its engines are bound to (VLLM_CPU_OMP_THREADS_BIND), leased like GPUs
    # (glm5_matrix.machine.leases): cells that bind a core in common never run side by side.
    cores: tuple[int, ...] = ()
    min_compute_capability: str | None = None
    tp: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    axis: Axis | None = None
    timeout_minutes: int = DEFAULT_TIMEOUT_MINUTES
    # vLLM paths, "vllm/v1/core/" (a folder) or a file: its guard sets' and its own.
    guards: tuple[str, ...] = ()
    axis_guards: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per axis value
    # Cells this one runs for real (faults: e2e-cpu, pd-nixl-cpu): it guards what they guard and
    # reads what they read.
    runs: tuple[str, ...] = ()
    # Repository files its tests read beyond its environment, profile and tests (glob patterns).
    reads: tuple[str, ...] = ()

    @property
    def base_tags(self) -> list[str]:
        tags = ["gpu" if self.gpus else "cpu", self.suite]
        if self.gpus:
            tags.append(f"gpus-{self.gpus}")
        if self.min_compute_capability is not None:
            major, minor = parse_compute_capability(self.min_compute_capability)
            tags.append(f"sm{major}{minor}")
        if self.tp is not None:
            tags.append(f"tp-{self.tp}")
        return tags

    @property
    def variants(self) -> list[Variant]:
        if self.axis is None:
            return [Variant(self)]
        return [Variant(self, value) for value in self.axis.values]


@dataclass(frozen=True)
class Matrix:
    cells: tuple[Cell, ...]
    source: Path

    def cell(self, name: str) -> Cell:
        for cell in self.cells:
            if cell.name == name:
                return cell
        known = ", ".join(c.name for c in self.cells)
        raise UserError(f"unknown cell {name!r} (cells: {known})")

    @property
    def variants(self) -> list[Variant]:
        return [variant for cell in self.cells for variant in cell.variants]

    def variant(self, variant_id: str) -> Variant:
        for variant in self.variants:
            if variant_id in (variant.id, variant.slug):
                return variant
        known = ", ".join(v.id for v in self.variants)
        raise UserError(f"unknown cell {variant_id!r} (cells: {known})")

    def select(self, tag: str) -> list[Variant]:
        return [variant for variant in self.variants if tag in variant.tags]


def parse_compute_capability(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    if not match:
        raise ValueError(f"{text!r} is not a compute capability like 9.0")
    return int(match.group(1)), int(match.group(2))


def load_matrix(path: Path, known_envs: set[str] | None = None) -> Matrix:
    """Read and validate matrix.toml; any defect is a UserError naming the file and the field."""
    data = load_toml(path, "matrix file")
    unknown_top = set(data) - {"cells", "guard_sets"}
    if unknown_top:
        raise UserError(f"{path}: unknown top-level key {sorted(unknown_top)[0]!r}")
    raw_cells = data.get("cells")
    if not isinstance(raw_cells, dict) or not raw_cells:
        raise UserError(f"{path}: no [cells.NAME] tables")
    raw_sets = data.get("guard_sets", {})
    if not isinstance(raw_sets, dict):
        raise UserError(f"{path}: guard_sets: expected a table of path lists")
    guard_sets = {
        name: _guards(f"{path}: guard_sets.{name}", paths) for name, paths in raw_sets.items()
    }
    cells = tuple(
        _parse_cell(path, name, raw, known_envs, guard_sets) for name, raw in raw_cells.items()
    )
    return Matrix(cells=_resolve_runs(path, cells), source=path)


def _resolve_runs(path: Path, cells: tuple[Cell, ...]) -> tuple[Cell, ...]:
    """A cell that runs others (`runs`) guards what every variant of theirs guards."""
    by_name = {cell.name: cell for cell in cells}
    resolved = []
    for cell in cells:
        guards = list(cell.guards)
        for name in cell.runs:
            ran = by_name.get(name)
            if ran is None or ran is cell:
                known = ", ".join(c.name for c in cells if c is not cell)
                raise UserError(f"{path}: cells.{cell.name}.runs: no other cell {name!r} ({known})")
            if ran.runs:
                raise UserError(
                    f"{path}: cells.{cell.name}.runs: {name!r} runs cells itself (one level only)"
                )
            guards += [guard for variant in ran.variants for guard in variant.guards]
        resolved.append(replace(cell, guards=tuple(dict.fromkeys(guards))) if cell.runs else cell)
    return tuple(resolved)


def _parse_cell(
    path: Path,
    name: str,
    raw: Any,
    known_envs: set[str] | None,
    guard_sets: dict[str, tuple[str, ...]],
) -> Cell:
    where = f"{path}: cells.{name}"
    if not _NAME.match(name):
        raise UserError(f"{where}: cell names are lower-case letters, digits and '-'")
    if not isinstance(raw, dict):
        raise UserError(f"{where}: must be a table")
    for key, value in raw.items():
        expected = _CELL_FIELDS.get(key)
        if expected is None:
            raise UserError(f"{where}.{key}: unknown field (known: {', '.join(_CELL_FIELDS)})")
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise UserError(f"{where}.{key}: expected {expected.__name__}, got {value!r}")
    for required in ("description", "suite"):
        if required not in raw:
            raise UserError(f"{where}.{required}: missing")
    if raw["suite"] not in SUITES:
        raise UserError(f"{where}.suite: {raw['suite']!r} is not one of {', '.join(SUITES)}")
    if ("tests" in raw) == ("commands" in raw):
        raise UserError(f"{where}: give exactly one of tests or commands")
    tests = tuple(_strings(f"{where}.tests", raw["tests"])) if "tests" in raw else ()
    commands = tuple(
        tuple(_strings(f"{where}.commands[{i}]", command))
        for i, command in enumerate(raw.get("commands", []))
    )
    if "commands" in raw and not commands:
        raise UserError(f"{where}.commands: expected a non-empty list of commands")
    gpus = raw.get("gpus", 0)
    if gpus < 0:
        raise UserError(f"{where}.gpus: must be >= 0")
    cores = raw.get("cores", [])
    numbers = [c for c in cores if type(c) is int and c >= 0]  # bool is an int subclass
    if len(set(numbers)) != len(cores):
        raise UserError(f"{where}.cores: expected distinct core numbers >= 0, got {cores!r}")
    capability = raw.get("min_compute_capability")
    if capability is not None:
        try:
            parse_compute_capability(capability)
        except ValueError as exc:
            raise UserError(f"{where}.min_compute_capability: {exc}") from None
        if not gpus:
            raise UserError(f"{where}.min_compute_capability: set, but the cell needs no GPU")
    tp = raw.get("tp")
    if tp is not None and (tp < 1 or (gpus and tp > gpus)):
        raise UserError(f"{where}.tp: {tp} must be >= 1 and at most gpus ({gpus})")
    environment = raw.get("environment", {})
    for key, value in environment.items():
        if not isinstance(value, str):
            raise UserError(f"{where}.environment.{key}: values are strings, got {value!r}")
    axis = _parse_axis(f"{where}.axis", raw["axis"]) if "axis" in raw else None
    env = raw.get("env")
    envs_used = list(axis.values) if axis is not None and axis.name == "env" else [env]
    timeout = raw.get("timeout_minutes", DEFAULT_TIMEOUT_MINUTES)
    if timeout < 1:
        raise UserError(f"{where}.timeout_minutes: must be >= 1, got {timeout}")
    guards: list[str] = []
    for set_name in (
        _strings(f"{where}.guard_sets", raw["guard_sets"]) if "guard_sets" in raw else []
    ):
        if set_name not in guard_sets:
            known = ", ".join(sorted(guard_sets)) or "none"
            raise UserError(f"{where}.guard_sets: no [guard_sets] {set_name!r} (known: {known})")
        guards += guard_sets[set_name]
    if "guards" in raw:
        guards += _guards(f"{where}.guards", raw["guards"])
    axis_guards: dict[str, tuple[str, ...]] = {}
    for value, paths in raw.get("axis_guards", {}).items():
        if axis is None or value not in axis.values:
            known = ", ".join(axis.values) if axis is not None else "the cell has no axis"
            raise UserError(f"{where}.axis_guards.{value}: not an axis value ({known})")
        axis_guards[value] = _guards(f"{where}.axis_guards.{value}", paths)
    runs = tuple(_strings(f"{where}.runs", raw["runs"])) if "runs" in raw else ()
    reads = tuple(_strings(f"{where}.reads", raw["reads"])) if "reads" in raw else ()
    for pattern in reads:
        if pattern.startswith("/") or ".." in pattern.split("/") or "\\" in pattern:
            raise UserError(f"{where}.reads: {pattern!r} is not a path inside this repository")
    if env is not None and axis is not None and axis.name == "env":
        raise UserError(f"{where}.env: set both as a field and as the axis")
    for env_name in envs_used:
        if env_name is None:
            raise UserError(f"{where}.env: missing (or an axis named 'env')")
        if known_envs is not None and env_name not in known_envs:
            raise UserError(
                f"{where}.env: {env_name!r} has no envs/{env_name}.toml "
                f"(known: {', '.join(sorted(known_envs))})"
            )
    return Cell(
        name=name,
        description=raw["description"],
        suite=raw["suite"],
        env=env,
        tests=tests,
        commands=commands,
        profile=raw.get("profile"),
        gpus=gpus,
        cores=tuple(sorted(cores)),
        min_compute_capability=capability,
        tp=tp,
        settings=dict(raw.get("settings", {})),
        environment=dict(environment),
        axis=axis,
        timeout_minutes=timeout,
        guards=tuple(dict.fromkeys(guards)),
        axis_guards=axis_guards,
        runs=runs,
        reads=reads,
    )


def _parse_axis(where: str, raw: dict[str, Any]) -> Axis:
    for key, value in raw.items():
        expected = _AXIS_FIELDS.get(key)
        if expected is None:
            raise UserError(f"{where}.{key}: unknown field (known: {', '.join(_AXIS_FIELDS)})")
        if not isinstance(value, expected):
            raise UserError(f"{where}.{key}: expected {expected.__name__}, got {value!r}")
    for required in _AXIS_FIELDS:
        if required not in raw:
            raise UserError(f"{where}.{required}: missing")
    values = tuple(_strings(f"{where}.values", raw["values"]))
    if not values or len(set(values)) != len(values):
        raise UserError(f"{where}.values: must be a non-empty list of distinct strings")
    for value in values:
        if not _VALUE.match(value):
            raise UserError(f"{where}.values: {value!r} may hold only letters, digits, _ . -")
    return Axis(name=raw["name"], values=values, tag_prefix=raw["tag_prefix"])


def _guards(where: str, value: Any) -> tuple[str, ...]:
    paths = _strings(where, value)
    for path in paths:
        if not _GUARD.match(path) or "/../" in f"/{path}" or "/./" in f"/{path}":
            raise UserError(
                f"{where}: {path!r} is not a vLLM source path (vllm/..., a file, or a folder "
                "ending in /; no globs)"
            )
    if len(set(paths)) != len(paths):
        raise UserError(f"{where}: a path is listed twice")
    return tuple(paths)


def _strings(where: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not value:
        raise UserError(f"{where}: expected a non-empty list of strings, got {value!r}")
    return list(value)
