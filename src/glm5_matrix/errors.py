"""Bad input: the one exception type for it (the CLI and the noxfile turn it into one line and
exit 2), and the reader of the project's TOML data files, whose defects are such input."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


class UserError(Exception):
    """Bad input from the user (a file, a flag, the hardware): one clear line, non-zero exit."""


def load_toml(path: Path, what: str) -> dict[str, Any]:
    """A TOML data file (`what` names it in the error: "matrix file", ...), or a UserError: one
    line for a path that is missing, a folder, unreadable, not text, or not TOML."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: a folder, not a {what}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (a {what} is UTF-8 TOML)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
