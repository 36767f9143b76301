"""Profiles: what a cell runs on (a model config and what the suites expect of it).

`profiles/NAME/profile.toml` holds the expectations (each tolerance with its reason);
`profiles/NAME/config.json`, where present, is the model config. Profiles are data.

A profile may start from another (`extends = "NAME"` at its top): the base's tables, with this
profile's keys over them table by table, so a variant states only what differs (and the base's
tolerances keep their one reason, where they were measured, in one file). One level only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError, load_toml
from glm5_matrix.files import repo_root
from glm5_matrix.matrix.profile_schema import TOLERANCE_TABLES, check_profile
from glm5_matrix.matrix.tolerances import Tolerances


def profiles_dir(root: Path | None = None) -> Path:
    return (root or repo_root()) / "profiles"


@dataclass(frozen=True)
class Profile:
    name: str
    directory: Path
    data: dict[str, Any]
    # Its tolerance tables as built at load: "tolerances", "pd.tolerances", "dflash.tolerances".
    tolerance_tables: Mapping[str, Tolerances] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.directory / "config.json"

    def config(self) -> dict[str, Any]:
        try:
            return json.loads(self.config_path.read_text())
        except FileNotFoundError:
            raise UserError(f"profile {self.name}: {self.config_path} not found") from None
        except json.JSONDecodeError as exc:
            raise UserError(
                f"profile {self.name}: {self.config_path}: not valid JSON: {exc}"
            ) from None

    def tolerances(self, of: str = "") -> Tolerances:
        """[tolerances], or [OF.tolerances] ("pd", "dflash"): what the suites judge by."""
        table = f"{of}.tolerances" if of else "tolerances"
        try:
            return self.tolerance_tables[table]
        except KeyError:
            raise UserError(
                f"{self.directory / 'profile.toml'}: no [{table}] table, which this suite reads"
            ) from None

    def section(self, name: str) -> dict[str, Any]:
        value = self.data.get(name, {})
        if not isinstance(value, dict):
            raise UserError(f"{self.directory / 'profile.toml'}: [{name}] must be a table")
        return value


def profile_names(root: Path | None = None) -> list[str]:
    """The profiles of the checkout at `root` (default: this one)."""
    return sorted(p.parent.name for p in profiles_dir(root).glob("*/profile.toml"))


def _over(base: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`base` with `own`'s keys over it, tables merged key by key."""
    merged = dict(base)
    for key, value in own.items():
        below = merged.get(key)
        if isinstance(value, dict) and isinstance(below, dict):
            merged[key] = _over(below, value)
        else:
            merged[key] = value
    return merged


def _read(name: str) -> tuple[Path, dict[str, Any]]:
    path = profiles_dir() / name / "profile.toml"
    if not path.is_file():
        raise UserError(
            f"unknown profile {name!r} (profiles: {', '.join(profile_names()) or 'none'})"
        )
    return path, load_toml(path, "profile")


def profile_chain(name: str, root: Path) -> list[str]:
    """The profile and the one it extends, if any (profiles under `root`, a checkout): the
    profile folders a cell's outcome reads. A profile not there is just its own name."""
    path = root / "profiles" / name / "profile.toml"
    base = load_toml(path, "profile").get("extends") if path.is_file() else None
    return [name, base] if isinstance(base, str) else [name]


def load_profile(name: str) -> Profile:
    path, data = _read(name)
    base = data.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise UserError(f"{path}: extends must be a profile name (a string)")
        base_data = _read(base)[1]
        if "extends" in base_data:
            raise UserError(f"{path}: extends {base!r}, which extends another (one level only)")
        data = _over(base_data, data)
    check_profile(path, data)  # a typo is one line here, before any environment or engine
    return Profile(name=name, directory=path.parent, data=data, tolerance_tables=_tolerances(data))


def _tolerances(data: dict[str, Any]) -> dict[str, Tolerances]:
    """The profile's tolerance tables, checked by check_profile, each built into Tolerances."""
    built: dict[str, Tolerances] = {}
    for table in TOLERANCE_TABLES:
        values: Any = data
        for part in table.split("."):
            values = values.get(part) if isinstance(values, dict) else None
        if isinstance(values, dict):
            built[table] = Tolerances.from_table(table, values)  # ranges checked: check_profile
    return built
