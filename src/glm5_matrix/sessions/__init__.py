"""The nox sessions' logic: running a cell (runner), the warm step, the harness's tools."""
