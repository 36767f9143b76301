"""The matrix: cells read from matrix.toml, validated, expanded over their axis, tagged.

A cell is one named nox session; its optional axis (MoE backend, KV connector, environment)
turns it into one parametrized session per value. Everything a session needs is here as data;
the noxfile only registers what this module returns. So are what a CI system needs to schedule
it (its timeout) and the vLLM source paths it guards (a change there should run it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from glm5_matrix import contracts
from glm5_matrix.errors import UserError
from glm5_matrix.files import MATRIX_FILE as MATRIX_FILE  # re-exported: callers import it here

SUITES = ("e2e", "offload", "pd", "dflash", "noise", "layout", "metadata", "unit", "lint", "faults")
# Suites whose cells start engines or servers (the others have nothing to warm).
ENGINE_SUITES = ("e2e", "offload", "dflash", "pd", "noise")
_NAME = r"[a-z0-9][a-z0-9-]*"
_VALUE = r"[A-Za-z0-9_.-]+"
# A vLLM source path, relative to the root of vLLM's repository: a file, or a folder ending in /.
_GUARD = re.compile(r"^vllm/(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]*$")
# A cell that gives no timeout gets this one (minutes): what a CI step is allowed.
DEFAULT_TIMEOUT_MINUTES = 60


def _guard_path(path: str) -> str | None:
    if not _GUARD.match(path) or "/../" in f"/{path}" or "/./" in f"/{path}":
        return (
            f"{path!r} is not a vLLM source path (vllm/..., a file, or a folder ending in /; "
            "no globs)"
        )
    return None


def _inside_repository(pattern: str) -> str | None:
    if pattern.startswith("/") or ".." in pattern.split("/") or "\\" in pattern:
        return f"{pattern!r} is not a path inside this repository"
    return None


def _compute_capability(text: str) -> str | None:
    try:
        parse_compute_capability(text)
    except ValueError as exc:
        return str(exc)
    return None


def _guards(doc: str) -> contracts.Spec:
    item = contracts.Spec(
        "str", check=_guard_path, check_says="vllm/... (a file, or a folder ending in /)"
    )
    return contracts.Spec("list", doc, items=item, nonempty=True, unique=True)


def _cell_rules(cell: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """What one cell's keys ask of each other."""
    if ("tests" in cell) == ("commands" in cell):
        yield "", "give exactly one of tests or commands"
    gpus = cell.get("gpus", 0)
    if "min_compute_capability" in cell and not gpus:
        yield "min_compute_capability", "set, but the cell needs no GPU"
    tp = cell.get("tp")
    if tp is not None and gpus and tp > gpus:
        yield "tp", f"{tp} must be at most gpus ({gpus})"
    axis = cell.get("axis")
    values = axis["values"] if axis is not None else []
    for value in cell.get("axis_guards", {}):
        if value not in values:
            known = ", ".join(values) if axis is not None else "the cell has no axis"
            yield f"axis_guards.{value}", f"not an axis value ({known})"
    by_axis = axis is not None and axis["name"] == "env"
    if "env" in cell and by_axis:
        yield "env", "set both as a field and as the axis"
    elif "env" not in cell and not by_axis:
        yield "env", "missing (or an axis named 'env')"


AXIS = contracts.table(
    {
        "name": contracts.Spec("str", "the settings key the value is passed under", required=True),
        "values": contracts.Spec(
            "list",
            "one session per value: CELL(VALUE)",
            required=True,
            nonempty=True,
            unique=True,
            items=contracts.Spec("str", pattern=_VALUE, pattern_says="letters, digits, _ . - only"),
        ),
        "tag_prefix": contracts.Spec("str", "each value's tag: PREFIX-VALUE", required=True),
    },
    "the cell's axis: one parametrized session per value",
)
CELL = contracts.table(
    {
        "description": contracts.Spec("str", "one line: what the cell asserts", required=True),
        "suite": contracts.Spec("str", "the kind of cell", required=True, choices=SUITES),
        "env": contracts.Spec("str", "its environment: envs/ENV.toml"),
        "tests": contracts.strings("pytest paths it runs", nonempty=True),
        "commands": contracts.Spec(
            "list",
            "commands it runs instead of pytest",
            nonempty=True,
            items=contracts.strings(nonempty=True),
        ),
        "profile": contracts.Spec("str", "its profile: profiles/PROFILE/profile.toml"),
        "gpus": contracts.Spec("int", "the GPUs it leases", default=0, minimum=0),
        "cores": contracts.Spec(
            "list",
            "the CPU cores its engines are bound to (VLLM_CPU_OMP_THREADS_BIND), leased like GPUs",
            unique=True,
            items=contracts.Spec("int", minimum=0),
        ),
        "min_compute_capability": contracts.Spec(
            "str",
            "the least compute capability of its GPUs",
            check=_compute_capability,
            check_says="like 9.0",
        ),
        "tp": contracts.Spec("int", "its tensor parallel size", minimum=1),
        "settings": contracts.open_table("passed to the suites"),
        "environment": contracts.entries(
            contracts.Spec("str"), "variables set for the cell (strings)"
        ),
        "axis": AXIS,
        "timeout_minutes": contracts.Spec(
            "int", "what a CI step gets", default=DEFAULT_TIMEOUT_MINUTES, minimum=1
        ),
        "guard_sets": contracts.strings("named sets of [guard_sets] it guards", nonempty=True),
        "guards": _guards("vLLM source paths it guards beyond its sets"),
        "axis_guards": contracts.entries(
            _guards("an axis value's own guards"), "per axis value: the vLLM paths it guards"
        ),
        "runs": contracts.strings(
            "cells it runs for real: it guards what they guard and reads what they read",
            nonempty=True,
        ),
        "reads": contracts.strings(
            "repository files its tests read beyond its environment, profile and tests (globs)",
            nonempty=True,
            item=contracts.Spec(
                "str", nonempty=True, check=_inside_repository, check_says="inside the repository"
            ),
        ),
    },
    "one nox session (or one per axis value)",
    rules=(_cell_rules,),
    rules_say=(
        "Exactly one of tests or commands; env, or an axis named env; tp at most gpus; "
        "min_compute_capability only with gpus; axis_guards only for axis values.",
    ),
)
MATRIX = contracts.table(
    {
        "cells": contracts.entries(
            CELL,
            "the cells: [cells.NAME]",
            names=_NAME,
            names_say="lower-case letters, digits and '-'",
            required=True,
            nonempty=True,
        ),
        "guard_sets": contracts.entries(
            _guards("a named set of vLLM source paths"),
            "named sets of vLLM source paths cells guard (guard_sets = [...])",
            default={},
        ),
    },
    "matrix.toml: the cells",
)


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
    min_compute_capability: Capability | None = None  # parsed once, at load
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
            major, minor = self.min_compute_capability
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


class Capability(NamedTuple):
    """A GPU's compute capability, 9.0 as (9, 0): it compares as the tuple."""

    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


def parse_compute_capability(text: str) -> Capability:
    """ "9.0" as Capability(9, 0): a cell's minimum (once, at load), GLM5_MATRIX_GPUS' and
    nvidia-smi's GPUs (glm5_matrix.machine.hardware)."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    if not match:
        raise ValueError(f"{text!r} is not a compute capability like 9.0")
    return Capability(int(match.group(1)), int(match.group(2)))


def load_matrix(
    path: Path, known_envs: set[str] | None = None, known_profiles: set[str] | None = None
) -> Matrix:
    """Read and check matrix.toml (MATRIX: every key, type and range, and each cell's rules),
    then what it names: environments in `known_envs` and profiles in `known_profiles` where
    given, guard sets, the cells a cell runs. Every defect is a line of one UserError naming the
    file, the table and the key."""
    data = contracts.read(path, MATRIX, "matrix file")
    guard_sets = {name: tuple(paths) for name, paths in data["guard_sets"].items()}
    found = [
        problem
        for name, raw in data["cells"].items()
        for problem in _references(name, raw, guard_sets, known_envs, known_profiles)
    ]
    contracts.raise_for(path, found)
    cells = tuple(_cell(name, raw, guard_sets) for name, raw in data["cells"].items())
    return Matrix(cells=_resolve_runs(path, cells), source=path)


def _references(
    name: str,
    raw: dict[str, Any],
    guard_sets: dict[str, tuple[str, ...]],
    known_envs: set[str] | None,
    known_profiles: set[str] | None,
) -> Iterator[contracts.Problem]:
    """The names a cell gives that must exist elsewhere: its environments, profile and sets."""
    where = f"cells.{name}"
    axis = raw.get("axis")
    envs = axis["values"] if axis is not None and axis["name"] == "env" else [raw["env"]]
    for env in envs:
        if known_envs is not None and env not in known_envs:
            yield contracts.Problem(
                f"{where}.env",
                f"{env!r} has no envs/{env}.toml" + contracts.nearest(env, known_envs),
            )
    profile = raw.get("profile")
    if known_profiles is not None and profile is not None and profile not in known_profiles:
        yield contracts.Problem(
            f"{where}.profile",
            f"{profile!r} has no profiles/{profile}/profile.toml"
            + contracts.nearest(profile, known_profiles),
        )
    for set_name in raw.get("guard_sets", []):
        if set_name not in guard_sets:
            yield contracts.Problem(
                f"{where}.guard_sets",
                f"no [guard_sets] {set_name!r}" + contracts.nearest(set_name, guard_sets),
            )


def _resolve_runs(path: Path, cells: tuple[Cell, ...]) -> tuple[Cell, ...]:
    """A cell that runs others (`runs`) guards what every variant of theirs guards."""
    by_name = {cell.name: cell for cell in cells}
    resolved = []
    for cell in cells:
        guards = list(cell.guards)
        for name in cell.runs:
            ran = by_name.get(name)
            if ran is None or ran is cell:
                others = [c.name for c in cells if c is not cell]
                raise UserError(
                    f"{path}: cells.{cell.name}.runs: no other cell {name!r}"
                    + contracts.nearest(name, others)
                )
            if ran.runs:
                raise UserError(
                    f"{path}: cells.{cell.name}.runs: {name!r} runs cells itself (one level only)"
                )
            guards += [guard for variant in ran.variants for guard in variant.guards]
        resolved.append(replace(cell, guards=tuple(dict.fromkeys(guards))) if cell.runs else cell)
    return tuple(resolved)


def _cell(name: str, raw: dict[str, Any], guard_sets: dict[str, tuple[str, ...]]) -> Cell:
    """A cell from its checked table."""
    guards = [path for set_name in raw.get("guard_sets", []) for path in guard_sets[set_name]]
    axis = raw.get("axis")
    return Cell(
        name=name,
        description=raw["description"],
        suite=raw["suite"],
        env=raw.get("env"),
        tests=tuple(raw.get("tests", ())),
        commands=tuple(tuple(command) for command in raw.get("commands", ())),
        profile=raw.get("profile"),
        gpus=raw["gpus"],
        cores=tuple(sorted(raw.get("cores", ()))),
        min_compute_capability=(
            parse_compute_capability(raw["min_compute_capability"])
            if "min_compute_capability" in raw
            else None
        ),
        tp=raw.get("tp"),
        settings=dict(raw.get("settings", {})),
        environment=dict(raw.get("environment", {})),
        axis=Axis(axis["name"], tuple(axis["values"]), axis["tag_prefix"]) if axis else None,
        timeout_minutes=raw["timeout_minutes"],
        guards=tuple(dict.fromkeys([*guards, *raw.get("guards", ())])),
        axis_guards={value: tuple(paths) for value, paths in raw.get("axis_guards", {}).items()},
        runs=tuple(raw.get("runs", ())),
        reads=tuple(raw.get("reads", ())),
    )
