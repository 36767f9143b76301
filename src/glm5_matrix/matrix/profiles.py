"""Profiles: what a cell runs on (a model config and what the suites expect of it).

`profiles/NAME/profile.toml` holds the expectations (each tolerance with its reason);
`profiles/NAME/config.json`, where present, is the model config. Profiles are data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError, load_toml

# repo_root lives with the other paths; kernels/, mutants/ and upstream/ still import it from here.
from glm5_matrix.files import repo_root as repo_root
from glm5_matrix.matrix.profile_schema import check_profile


def profiles_dir() -> Path:
    return repo_root() / "profiles"


@dataclass(frozen=True)
class Profile:
    name: str
    directory: Path
    data: dict[str, Any]

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

    def section(self, name: str) -> dict[str, Any]:
        value = self.data.get(name, {})
        if not isinstance(value, dict):
            raise UserError(f"{self.directory / 'profile.toml'}: [{name}] must be a table")
        return value


def profile_names() -> list[str]:
    return sorted(p.parent.name for p in profiles_dir().glob("*/profile.toml"))


def load_profile(name: str) -> Profile:
    directory = profiles_dir() / name
    path = directory / "profile.toml"
    if not path.is_file():
        raise UserError(
            f"unknown profile {name!r} (profiles: {', '.join(profile_names()) or 'none'})"
        )
    data = load_toml(path, "profile")
    check_profile(path, data)  # a typo is one line here, before any environment or engine
    return Profile(name=name, directory=directory, data=data)
