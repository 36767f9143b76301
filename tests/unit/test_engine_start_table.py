"""benchmarks/engine_start.py --table on results folders written by the real results writer:
cold against warm per configuration, the ratio warm/cold and the bar (<= 0.2), bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from glm5_matrix.files import repo_root, write_json_atomic

SCRIPT = repo_root() / "benchmarks" / "engine_start.py"


Start = tuple[str, float, dict[str, int] | None] | tuple[str, float, dict[str, int], int | None]


def _results(folder: Path, *starts: Start) -> None:
    """Engine starts as the engines record them; `files_before` (the 4th item) defaults to 0,
    a start on an empty kernel cache, and None leaves it out as records before it did."""
    entries = []
    for label, seconds, added, *held in starts:
        entry: dict = {"label": label, "seconds": seconds, "test": None}
        if added is not None:
            entry["compile"] = {"seconds": 0.0, "entries_added": added, "guard": False}
            before = held[0] if held else 0
            if before is not None:
                entry["compile"]["files_before"] = before
        entries.append(entry)
    write_json_atomic(folder / "results.json", {"engine_starts": entries, "tests": {}})


def _table(cold: Path, warm: Path, out: Path) -> tuple[subprocess.CompletedProcess, list]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--table", str(cold), str(warm), "--json", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    return done, json.loads(out.read_text()) if out.is_file() else []


def test_table_cold_against_warm_with_the_bar(tmp_path: Path) -> None:
    """The H200's figures (issue 26): e2e-tp1(deep_gemm) 292.7 s cold, 46.1 s and 37.7 s warm."""
    cold, warm = tmp_path / "warm", tmp_path / "cells"
    _results(cold / "e2e-tp1-deep_gemm", ("engine:tp1-deep_gemm", 292.7, {"deep_gemm": 120}))
    _results(cold / "offload-tp1-simple", ("engine:tp1-offload", 210.0, {"triton": 30}))
    _results(
        warm / "e2e-tp1-deep_gemm",
        ("engine:tp1-deep_gemm", 37.7, {"deep_gemm": 0}),
        ("engine:tp1-deep_gemm", 46.1, {"deep_gemm": 0}),  # the slowest start counts
    )
    _results(warm / "offload-tp1-simple", ("engine:tp1-offload", 40.0, None))
    done, rows = _table(cold, warm, tmp_path / "table.json")
    assert done.returncode == 0, done.stdout + done.stderr
    by = {row["configuration"]: row for row in rows}
    assert by["engine:tp1-deep_gemm"]["ratio"] == round(46.1 / 292.7, 4)
    assert by["engine:tp1-deep_gemm"]["within"] is True
    assert by["engine:tp1-deep_gemm"]["warm"]["seconds"] == 46.1
    line = next(x for x in done.stdout.splitlines() if x.startswith("engine:tp1-deep_gemm"))
    assert line.split()[1:5] == ["292.7", "46.1", "0.16", "yes"]
    assert "deep_gemm 120 | nothing" in line
    offload = next(x for x in done.stdout.splitlines() if x.startswith("engine:tp1-offload"))
    assert "0.19" in offload and "triton 30 | not measured" in offload
    assert "warm/cold" in done.stdout and "<= 0.2" in done.stdout
    assert "met by all 2 configuration(s) compared" in done.stdout


def test_the_cold_folder_inside_the_warm_one_is_not_read_as_warm(tmp_path: Path) -> None:
    """`--table results/warm results`: the warm step's own starts are not the cells' starts."""
    results = tmp_path / "results"
    _results(results / "warm" / "e2e-tp1-graphs", ("engine:graphs", 415.5, {"triton": 64}))
    _results(results / "e2e-tp1-graphs", ("engine:graphs", 59.0, {"triton": 0}))
    done, rows = _table(results / "warm", results, tmp_path / "table.json")
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = rows
    assert (row["cold"]["seconds"], row["warm"]["seconds"]) == (415.5, 59.0)


def test_table_fails_over_the_bar_and_with_nothing_to_compare(tmp_path: Path) -> None:
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    _results(cold / "a", ("engine:a", 100.0, {}), ("engine:only-cold", 50.0, {}))
    _results(warm / "a", ("engine:a", 21.0, {}))  # 0.21 > 0.2
    done, rows = _table(cold, warm, tmp_path / "t.json")
    assert done.returncode == 1
    assert "missed by 1 of 1: engine:a (0.21)" in done.stdout
    assert {r["configuration"]: r["within"] for r in rows} == {
        "engine:a": False,
        "engine:only-cold": None,
    }
    only_cold = next(x for x in done.stdout.splitlines() if x.startswith("engine:only-cold"))
    assert only_cold.split()[1:5] == ["50.0", "-", "-", "-"]

    empty = tmp_path / "empty"
    empty.mkdir()
    done, _ = _table(cold, empty, tmp_path / "u.json")
    assert done.returncode == 1 and "no configuration has both" in done.stdout


def test_table_bad_input_is_one_line(tmp_path: Path) -> None:
    done, _ = _table(tmp_path / "absent", tmp_path, tmp_path / "x.json")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"engine_start.py: --table: {tmp_path / 'absent'}: folder not found"
    ]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text("{not json")
    done, _ = _table(broken, tmp_path, tmp_path / "y.json")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1
    assert "not a results file" in done.stderr


def test_only_a_start_on_an_empty_cache_is_cold(tmp_path: Path) -> None:
    """A configuration started after another in one warm step found that one's kernels (the
    H200's dflash-tp1 target after e2e's: 39.5 s against 38.6 s warm), and one recorded before
    files_before existed is unknown: both shown and marked, neither held to the bar."""
    cold, warm = tmp_path / "warm", tmp_path / "cells"
    _results(
        cold / "dflash-tp1",
        ("engine:target", 292.7, {"deep_gemm": 120}, 0),
        ("engine:drafted", 39.5, {"triton": 48}, 1030),
        ("engine:old", 300.0, {"triton": 9}, None),
    )
    _results(
        warm / "dflash-tp1",
        ("engine:target", 46.1, {}),
        ("engine:drafted", 38.6, {}),
        ("engine:old", 45.0, {}),
    )
    done, rows = _table(cold, warm, tmp_path / "t.json")
    assert done.returncode == 0, done.stdout + done.stderr
    by = {row["configuration"]: row for row in rows}
    assert by["engine:target"]["within"] is True and by["engine:target"]["cold_files_before"] == 0
    assert by["engine:drafted"]["within"] is None and by["engine:drafted"]["ratio"] == 0.9772
    assert by["engine:drafted"]["cold_files_before"] == 1030
    assert by["engine:old"]["within"] is None and by["engine:old"]["cold_files_before"] is None
    lines = {x.split()[0]: x for x in done.stdout.splitlines() if x.startswith("engine:")}
    assert "0.98  not cold (1030 files)" in lines["engine:drafted"]
    assert "not known cold" in lines["engine:old"]
    assert "met by all 1 configuration(s) compared" in done.stdout

    # The control: the same drafted start on an empty cache is held to the bar and misses it.
    _results(cold / "dflash-tp1", ("engine:drafted", 39.5, {"triton": 48}, 0))
    done, rows = _table(cold, warm, tmp_path / "u.json")
    assert done.returncode == 1
    assert "missed by 1 of 1: engine:drafted (0.98)" in done.stdout

    only_warm_known = tmp_path / "old"
    _results(only_warm_known / "x", ("engine:old", 300.0, {"triton": 9}, None))
    done, _ = _table(only_warm_known, warm, tmp_path / "v.json")
    assert done.returncode == 1 and "no configuration has both a cold start" in done.stdout
