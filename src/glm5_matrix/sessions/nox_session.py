"""What the session bodies ask of the nox session they are handed (the noxfile's nox.Session):
this room's and the rooms above it that run as a nox session (upstream: `nox -s upstream`). A
structural type, so that their functions are typed without the package importing nox. Only the
parts they use, spelled as nox.Session spells them; mypy checks the noxfile's nox.Session
against it where the noxfile passes one in."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, NoReturn, Protocol, overload


class NoxSession(Protocol):
    @property
    def posargs(self) -> list[str]:
        """The session's arguments (after `--` on nox's command line)."""
        ...

    # As nox.Session.run: silent=True returns the command's output, otherwise whether it ran.
    @overload
    def run(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str | None] | None = None,
        silent: Literal[False] = False,
        external: Literal["error", True, False] | None = None,
        interrupt_timeout: float | None = 0.3,
        terminate_timeout: float | None = 0.2,
    ) -> bool | None: ...

    @overload
    def run(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str | None] | None = None,
        silent: Literal[True],
        external: Literal["error", True, False] | None = None,
        interrupt_timeout: float | None = 0.3,
        terminate_timeout: float | None = 0.2,
    ) -> str | None: ...

    # As nox.Session.run_install: runs under --install-only too (session.run is skipped there).
    def run_install(
        self,
        *args: str | os.PathLike[str],
        env: Mapping[str, str | None] | None = None,
        silent: bool = False,
        external: Literal["error", True, False] | None = None,
    ) -> str | bool | None: ...

    def log(self, *args: Any, **kwargs: Any) -> None: ...

    def warn(self, *args: Any, **kwargs: Any) -> None: ...

    def error(self, *args: Any) -> NoReturn:
        """End the session as failed (raises)."""
        ...

    def skip(self, *args: Any) -> NoReturn:
        """End the session as skipped (raises)."""
        ...


def install_only(session: NoxSession) -> bool:
    """Whether nox runs with --install-only: build the environments, run nothing. nox keeps
    this in its global config only (no public attribute); a session without one (a test's
    stand-in) is not install-only."""
    runner = getattr(session, "_runner", None)
    return bool(getattr(getattr(runner, "global_config", None), "install_only", False))
