"""How long the matrix's overheads take: `nox -l`, and building a cell's environment from a
cold uv cache, from a warm one, and reusing an unchanged venv.

    python benchmarks/matrix_timings.py [--env cpu] [--repeat 5] [--skip-cold]

Cold means an empty, temporary UV_CACHE_DIR (everything downloaded); warm means a fresh venv
from the populated cache (what a rebuilt cell pays); reuse is an unchanged venv. Numbers go
to stdout and, with --json FILE, to a file. Not a test: rerun it where the numbers matter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from glm5_matrix.envs import environments  # noqa: E402


def time_nox_list(repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-l"],
            check=True,
            capture_output=True,
        )
        samples.append(time.perf_counter() - start)
    return samples


def time_build(env_name: str, venv: Path, cache: Path | None) -> float:
    env = environments.load_envs(ROOT)[env_name]
    environ = dict(os.environ)
    if cache is not None:
        environ["UV_CACHE_DIR"] = str(cache)

    def run(command: list[str]) -> None:
        subprocess.run(command, check=True, env=environ, stdout=subprocess.DEVNULL)

    start = time.perf_counter()
    # The user's environment (pip's sources for torch), less an interpreter that would skip the build.
    mine = {k: v for k, v in environ.items() if k != environments.PYTHON_VARIABLE}
    environments.build(env, venv, run=run, environ=mine)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="cpu", help="environment definition (envs/NAME.toml)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of `nox -l`")
    parser.add_argument("--skip-cold", action="store_true", help="no cold-cache build")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    figures: dict[str, object] = {"env": args.env}
    samples = time_nox_list(args.repeat)
    figures["nox_list_seconds"] = {
        "median": round(statistics.median(samples), 3),
        "max": round(max(samples), 3),
        "runs": len(samples),
    }
    print(f"nox -l: median {statistics.median(samples):.3f} s over {len(samples)} runs")

    with tempfile.TemporaryDirectory(
        prefix="glm5-bench-", dir=ROOT / ".nox" if (ROOT / ".nox").is_dir() else None
    ) as tmp:
        tmp_path = Path(tmp)
        if not args.skip_cold:
            cache = tmp_path / "uv-cache"
            cold = time_build(args.env, tmp_path / "cold", cache)
            figures["cold_build_seconds"] = round(cold, 1)
            print(f"{args.env}: cold build (empty uv cache) {cold:.1f} s")
            warm = time_build(args.env, tmp_path / "warm", cache)
        else:
            warm = time_build(args.env, tmp_path / "warm", None)
            warm = time_build(args.env, tmp_path / "warm2", None)
        figures["warm_build_seconds"] = round(warm, 1)
        print(f"{args.env}: warm build (fresh venv, populated uv cache) {warm:.1f} s")
        reuse = time_build(
            args.env, tmp_path / "warm", None if args.skip_cold else tmp_path / "uv-cache"
        )
        figures["reuse_seconds"] = round(reuse, 2)
        print(f"{args.env}: reuse of an unchanged venv {reuse:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
