"""Throughput and peak memory of `glm5-matrix prune` against a plain copy of the same bytes.

Writes a synthetic full GLM-5.3-Flash checkpoint (45 layers + MTP, published tensor names and
dtypes, widths scaled so the checkpoint is about --size-gb) into a temporary directory, then:

- prunes it to --layers (default 4, the 4L checkpoint) and to all 45 layers (every byte copied,
  the MTP layer keeping its number), each in a child process that reports its peak RSS
  (VmHWM);
- copies the same shards with shutil.copyfile (+ fsync, as prune fsyncs its shards).

Source pages are evicted with posix_fadvise(DONTNEED) before each run, so every run reads the
same way. With --repeat R the three runs are repeated R times, interleaved (the order of prune
and copy alternates between rounds), so load from other processes falls on both alike; each
prune row shows its wall time over the same round's copy, and the summary the median of those
ratios. GB/CPU-s is bytes written per CPU-second of the process (all its threads), which
depends less on other load than the wall time does; the load column is the 1-minute load
average when the run started. Prints a table; deletes everything unless --keep.

    PYTHONPATH=src python benchmarks/prune_throughput.py [--size-gb 3] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "unit"))  # the synthetic checkpoint, test scaffolding

import synthetic_checkpoint as synthetic  # noqa: E402

# Widths under which the expert count is scaled to reach the target size.
BENCH_TEXT_WIDTHS = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32768,
    "eos_token_id": [32000, 32001, 32002],
    "pad_token_id": 32000,
    "kv_lora_rank": 128,
    "q_lora_rank": 192,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "qk_head_dim": 64,
    "index_topk": 256,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "linear_attn_config": {"num_heads": 8, "head_dim": 64},
}
BENCH_VISION_WIDTHS = {
    "depth": 4,
    "hidden_size": 256,
    "num_heads": 4,
    "intermediate_size": 1024,
    "out_hidden_size": 512,
    "projection_intermediate_size": 1280,
}

# A child that runs the subcommand as the console script does (cli.py's dispatch).
# It reports its own VmHWM: rusage's ru_maxrss would also count the parent's pages the
# child held between fork and exec.
CHILD = """
import argparse, re, sys
from pathlib import Path
from glm5_matrix import checkpoints
code = 0
if sys.argv[2:] != ["noop"]:
    parser = argparse.ArgumentParser(prog="glm5-matrix")
    checkpoints.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[2:])
    code = args.func(args)
import resource
usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread, the hashing one included
peak_kb = re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]
Path(sys.argv[1]).write_text(f"{peak_kb} {usage.ru_utime + usage.ru_stime}")
sys.exit(code)
"""


@dataclass(frozen=True)
class Row:
    name: str
    nbytes: int
    wall: float
    cpu: float
    rss: int | None
    load: float  # 1-minute load average when the run started


def bench_config(size_bytes: int) -> dict:
    def config(experts: int) -> dict:
        widths = {**BENCH_TEXT_WIDTHS, "n_routed_experts": experts}
        return synthetic.full_config(
            text_widths=widths, vision_widths=BENCH_VISION_WIDTHS, weight_block_size=[128, 128]
        )

    low, high = 8, 4096
    while low < high:  # the smallest expert count reaching the target size
        mid = (low + high) // 2
        if synthetic.checkpoint_bytes(config(mid)) >= size_bytes:
            high = mid
        else:
            low = mid + 1
    return config(low)


def evict(directory: Path) -> None:
    """Write back and drop the source's pages, so no run pays for another's dirty pages and
    every run reads the source from disk."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED drops clean pages only
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_child(work: Path, *argv: str) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in bytes) of one child running the subcommand."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    report = work / "vmhwm"
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(report), *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        timeout=3600,
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"child {' '.join(argv)} exited {result.returncode}")
    peak_kb, cpu = report.read_text().split()
    return elapsed, float(cpu), int(peak_kb) * 1024


def shard_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plain_copy(source: Path, target: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of copying every shard with shutil.copyfile."""
    target.mkdir()
    start, cpu_start = time.perf_counter(), cpu_seconds()
    for path in sorted(source.glob("*.safetensors")):
        shutil.copyfile(path, target / path.name)
        fd = os.open(target / path.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - start, cpu_seconds() - cpu_start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=3.0, help="source size (default 3)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args()

    size = int(args.size_gb * 1e9)
    free = shutil.disk_usage(args.dir).free
    if free < 3.5 * size:
        raise SystemExit(f"{args.dir}: {free / 1e9:.1f} GB free, need {3.5 * size / 1e9:.1f} GB")
    work = Path(tempfile.mkdtemp(prefix="prune-bench-", dir=args.dir))
    try:
        config = bench_config(size)
        experts = config["text_config"]["n_routed_experts"]
        start = time.perf_counter()
        ckpt = synthetic.write_checkpoint(work / "full", config, num_shards=12)
        written = time.perf_counter() - start
        print(
            f"source: {ckpt.data_bytes / 1e9:.2f} GB, {len(ckpt.tensors)} tensors, "
            f"{len(ckpt.shard_files)} shards, {experts} experts/layer (written in {written:.1f} s)"
        )
        _, _, import_rss = run_child(work, "noop")

        def prune(layers: int) -> Row:
            dst = work / f"pruned-{layers}"
            evict(work / "full")
            load = os.getloadavg()[0]
            wall, cpu, rss = run_child(
                work, "prune", str(work / "full"), str(dst), "--layers", str(layers)
            )
            row = Row(f"prune --layers {layers}", shard_bytes(dst), wall, cpu, rss, load)
            shutil.rmtree(dst)
            return row

        def copy() -> Row:
            evict(work / "full")
            load = os.getloadavg()[0]
            wall, cpu = plain_copy(work / "full", work / "copy")
            row = Row(
                "shutil.copyfile all shards", shard_bytes(work / "copy"), wall, cpu, None, load
            )
            shutil.rmtree(work / "copy")
            return row

        rounds: list[tuple[list[Row], Row, Row]] = []  # (rows in run order, copy, prune 45)
        for number in range(args.repeat):
            if number % 2 == 0:
                rows = [prune(args.layers), prune(45), copy()]
            else:
                rows = [copy(), prune(args.layers), prune(45)]
            copied = next(r for r in rows if r.rss is None)
            rounds.append((rows, copied, next(r for r in rows if r.name == "prune --layers 45")))

        # CPU seconds next to wall seconds: on a shared machine the wall figure depends on load.
        print(
            f"\n{'round':>5} {'run':<28} {'GB written':>10} {'wall s':>7} {'GB/s':>6} "
            f"{'CPU s':>6} {'GB/CPU-s':>8} {'peak RSS':>9} {'/copy':>6} {'load':>5}"
        )
        for number, (rows, copied, _) in enumerate(rounds, start=1):
            for row in rows:
                gb = row.nbytes / 1e9
                rss_text = f"{row.rss / 2**20:.0f} MiB" if row.rss else "-"
                ratio = "" if row is copied else f"{row.wall / copied.wall:.2f}"
                print(
                    f"{number:>5} {row.name:<28} {gb:>10.3f} {row.wall:>7.2f} {gb / row.wall:>6.2f} "
                    f"{row.cpu:>6.2f} {gb / row.cpu:>8.2f} {rss_text:>9} {ratio:>6} {row.load:>5.1f}"
                )
        ratios = [p.wall / c.wall for _, c, p in rounds]
        per_cpu = [(p.nbytes / p.cpu / 1e9, c.nbytes / c.cpu / 1e9) for _, c, p in rounds]
        print(
            f"\nprune --layers 45 / copy, wall time: median {statistics.median(ratios):.2f} over "
            f"{len(ratios)} round(s) ({', '.join(f'{r:.2f}' for r in ratios)})\n"
            "GB per CPU-second, prune --layers 45 / copy: "
            + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in per_cpu)
        )
        print(f"(a child that only imports the tool peaks at {import_rss / 2**20:.0f} MiB RSS)")
        print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
