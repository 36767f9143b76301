"""Hardware preflight through the GLM5_MATRIX_GPUS override; nvidia-smi's GPU list bounded by
CUDA_VISIBLE_DEVICES; the topology parser on recorded `nvidia-smi topo -m` outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.machine import hardware
from glm5_matrix.machine.hardware import (
    Topology,
    bound_by_visible,
    check,
    check_override,
    detect,
    parse_query,
    parse_topology,
    read_topology,
    strict,
)


def test_a_malformed_override_is_refused_before_detection() -> None:
    check_override({})  # unset: nvidia-smi decides, later
    check_override({"GLM5_MATRIX_GPUS": ""})  # no GPU
    check_override({"GLM5_MATRIX_GPUS": "9.0,8.9"})
    with pytest.raises(UserError) as raised:
        check_override({"GLM5_MATRIX_GPUS": "abc"})
    assert str(raised.value) == "GLM5_MATRIX_GPUS='abc': 'abc' is not a compute capability like 9.0"


@pytest.mark.parametrize(
    ("gpus", "cell", "runnable"),
    [
        ("", "e2e-tp1", False),
        ("9.0", "e2e-tp1", True),
        ("8.9", "e2e-tp1", False),  # an L4 is too old for the sparse MLA kernels
        ("10.0", "e2e-tp1", True),
        ("9.0", "pd-nixl", False),
        ("9.0,9.0", "pd-nixl", True),
        ("9.0,8.0", "e2e-tp2", False),  # only GPUs that qualify count
        ("9.0,9.0", "e2e-tp4", False),
        ("9.0,9.0,9.0,9.0", "e2e-tp4", True),
        ("", "e2e-cpu", True),
        ("", "layout", True),
    ],
)
def test_override_decides(matrix, gpus, cell, runnable):
    found = detect({"GLM5_MATRIX_GPUS": gpus})
    verdict = check(matrix.cell(cell), found)
    assert verdict.runnable is runnable, verdict.reason


def test_skip_reason_names_need_and_finding(matrix):
    verdict = check(matrix.cell("pd-nixl"), detect({"GLM5_MATRIX_GPUS": "9.0"}))
    assert "pd-nixl needs 2 GPU(s) with compute capability >= 9.0" in verdict.reason
    assert "found 1 GPU(s) with compute capability 9.0" in verdict.reason
    verdict = check(matrix.cell("e2e-tp1"), detect({"GLM5_MATRIX_GPUS": ""}))
    assert "found no GPU (GLM5_MATRIX_GPUS='')" in verdict.reason


def test_malformed_override_is_an_error():
    with pytest.raises(UserError, match="GLM5_MATRIX_GPUS='nine'"):
        detect({"GLM5_MATRIX_GPUS": "nine"})


def test_detection_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    found = detect({})
    assert found.capabilities == ()
    assert "nvidia-smi not found" in found.describe()


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("true", True), ("", False), ("0", False)]
)
def test_strict(value, expected):
    assert strict({"GLM5_MATRIX_STRICT": value}) is expected
    assert strict({}) is False


# --- what nvidia-smi reports, bounded by CUDA_VISIBLE_DEVICES ----------------------------------

# `nvidia-smi --query-gpu=index,uuid,compute_cap --format=csv,noheader` on an 8-GPU SM90 node.
QUERY = "".join(f"{i}, GPU-{i}a3c7f2e-51b2-{i}d4e-9c1a-0e5b7d2f8c{i}{i}, 9.0\n" for i in range(8))


def test_query_parses_index_uuid_and_capability():
    gpus = parse_query(QUERY)
    assert [gpu[0] for gpu in gpus] == list(range(8))
    assert gpus[3][1].startswith("GPU-3a3c7f2e") and gpus[3][2] == (9, 0)


@pytest.mark.parametrize(
    ("visible", "indices"),
    [
        ("4,5,6,7", [4, 5, 6, 7]),  # a runner given GPUs 4-7 leases among those only
        ("6,4", [4, 6]),
        ("GPU-5a3c7f2e-51b2-5d4e-9c1a-0e5b7d2f8c55,GPU-2a3c", [2, 5]),  # UUIDs and a prefix
        ("", []),
        ("-1", []),
        ("3,MIG-7f2e,5", [3]),  # CUDA stops at the first entry that names no GPU
        ("1,9,2", [1]),  # an index this box does not have also ends the list
        ("GPU-", []),  # a prefix of every UUID names none
    ],
)
def test_cuda_visible_devices_bounds_what_is_found(visible, indices):
    assert [gpu[0] for gpu in bound_by_visible(parse_query(QUERY), visible)] == indices


def test_override_numbers_its_gpus_from_zero():
    found = detect({"GLM5_MATRIX_GPUS": "9.0,8.0,9.0"})
    assert found.indices == (0, 1, 2)


# --- topology ------------------------------------------------------------------------------------

TOPO = Path(__file__).parents[1] / "data" / "nvidia-smi-topo"


def topology(name: str) -> Topology:
    return parse_topology((TOPO / name).read_text())


def test_topology_of_an_nvswitch_node():
    topo = topology("h100-sxm-8gpu.txt")
    assert len(topo.links) == 28 and set(topo.links.values()) == {"NV18"}
    assert topo.numa == {0: "0", 1: "0", 2: "0", 3: "0", 4: "1", 5: "1", 6: "1", 7: "1"}
    assert topo.rank(7, 2) == 118


def test_topology_of_a_hybrid_cube_mesh_ignores_the_nics():
    topo = topology("dgx1-v100-8gpu.txt")
    assert len(topo.links) == 28  # GPU pairs only: the mlx5 rows and columns are not GPUs
    assert (topo.link(0, 1), topo.link(0, 3), topo.link(3, 4), topo.link(7, 3)) == (
        "NV1",
        "NV2",
        "SYS",
        "NV1",
    )
    assert topo.numa == {}  # no NUMA column in this driver's output
    assert topo.rank(0, 3) > topo.rank(0, 1) > topo.rank(3, 4)


def test_topology_with_tabs_nic_rows_and_numa_nodes():
    topo = topology("rtx4090-8gpu.txt")
    assert set(topo.links.values()) == {"SYS"} and len(topo.links) == 28
    assert [topo.numa[i] for i in range(8)] == ["0"] * 4 + ["1"] * 4


def test_topology_of_a_terminal_with_underlined_header():
    topo = topology("nv12-2gpu-terminal.txt")
    assert topo.links == {(0, 1): "NV12"}
    assert topo.numa == {0: "0", 1: "1"}


def test_topology_ranks_nvlink_over_pcie():
    topo = topology("rtx-a6000-3gpu.txt")
    assert topo.link(1, 0) == "NV4" and topo.link(0, 2) == "NODE"
    assert topo.rank(0, 1) > topo.rank(0, 2) > 0


def test_topology_of_one_gpu_and_of_nonsense():
    one = parse_topology(
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-63\t0\t\tN/A\n"
    )
    assert one.links == {} and one.numa == {0: "0"}
    with pytest.raises(ValueError, match="no GPU header"):
        parse_topology("No devices were found\n")
    with pytest.raises(ValueError, match="no GPU rows"):
        parse_topology("\tGPU0\tGPU1\n\nLegend:\n")


def test_no_topology_under_the_override():
    assert read_topology({"GLM5_MATRIX_GPUS": "9.0,9.0"}) is None


def test_the_device_model_without_a_gpu_is_the_cpu_s_name() -> None:
    found = hardware.device_model({hardware.GPUS_VARIABLE: ""})
    assert found.startswith("cpu: ") and len(found) > len("cpu: ")
