"""glm5_matrix.machine.gpu_memory: nvidia-smi's CSV (files in tests/unit/data, in the format of
`--query-gpu=index,uuid --format=csv,noheader` and `--query-compute-apps=gpu_uuid,pid,used_memory
--format=csv,noheader,nounits`), which GPUs are a cell's, and a machine without a driver."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from glm5_matrix.machine import gpu_memory
from glm5_matrix.machine.gpu_memory import Holder

DATA = Path(__file__).parents[1] / "data"
GPU0 = "GPU-3f6c2a91-8d4e-4b7a-a1c5-5e9d0b7f2c18"
GPU1 = "GPU-a84e17d0-2b9c-4f63-8e25-c7d1f04b9a36"


def test_parse_gpu_list() -> None:
    text = (DATA / "nvidia-smi-gpus.txt").read_text()
    assert gpu_memory.parse_gpu_list(text) == {GPU0: "0", GPU1: "1"}


def test_parse_compute_apps() -> None:
    text = (DATA / "nvidia-smi-apps-held.txt").read_text()
    assert gpu_memory.parse_compute_apps(text) == [
        (GPU0, 40121, 1024),
        (GPU1, 48213, 91204),
        (GPU1, 48377, None),  # [N/A]: the driver does not say (containers)
    ]
    assert gpu_memory.parse_compute_apps((DATA / "nvidia-smi-apps-none.txt").read_text()) == []
    # With units, and the line nvidia-smi prints when there is nothing to list.
    assert gpu_memory.parse_compute_apps(f"{GPU0}, 7, 512 MiB\n") == [(GPU0, 7, 512)]
    assert gpu_memory.parse_compute_apps("No running processes found\n") == []


def test_a_cells_gpus_are_the_first_visible_ones() -> None:
    assert gpu_memory.cell_gpus({}, 2) == ["0", "1"]
    assert gpu_memory.cell_gpus({"CUDA_VISIBLE_DEVICES": "3,1,2"}, 2) == ["3", "1"]
    assert gpu_memory.cell_gpus({"CUDA_VISIBLE_DEVICES": f"{GPU1}"}, 1) == [GPU1]


def test_select_by_index_or_uuid() -> None:
    held = [Holder("0", GPU0, 40121, 1024), Holder("1", GPU1, 48213, 91204)]
    assert gpu_memory.select(held, ["1"]) == [held[1]]
    assert gpu_memory.select(held, [GPU0]) == [held[0]]
    assert gpu_memory.select(held, ["GPU-a84e17d0"]) == [held[1]]  # a UUID prefix, as CUDA takes
    assert gpu_memory.select(held, ["2"]) == []
    assert held[1].describe() == "pid 48213 holds 91204 MiB on GPU 1"
    assert (
        Holder("1", GPU1, 5, None).describe() == "pid 5 holds memory (amount not reported) on GPU 1"
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_driver_there_is_nothing_to_ask() -> None:
    assert gpu_memory.holders(["0"]) is None
