"""The harness's tool sessions' argument handling (glm5_matrix.sessions.tools)."""

from __future__ import annotations

import socket

from glm5_matrix.sessions import tools


def test_docs_builds_strictly_by_default() -> None:
    assert tools.docs_arguments([]) == ["build", "--strict"]


def test_docs_serve_binds_loopback_at_a_free_port_not_8000() -> None:
    args = tools.docs_arguments(["serve"])
    assert args[:2] == ["serve", "--dev-addr"]
    host, port = args[2].rsplit(":", 1)
    assert host == "127.0.0.1"
    with socket.socket() as sock:  # free when chosen: it binds
        sock.bind((host, int(port)))


def test_docs_serve_keeps_an_address_the_caller_names() -> None:
    assert tools.docs_arguments(["serve", "-a", "127.0.0.1:9999"]) == [
        "serve",
        "-a",
        "127.0.0.1:9999",
    ]
