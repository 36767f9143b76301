"""The nox sessions' logic: running a cell (runner), the warm step, the harness's tools; what
they ask of the nox session they are handed (nox_session.NoxSession)."""
