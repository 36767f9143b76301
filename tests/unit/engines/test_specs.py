"""glm5_matrix.engines.specs without vLLM: the MoE backend mapping, the engine arguments a cell
gets, and when the JIT monitor joins them (kernel_guard.jit_monitor_mode, the guard's side of it, is
tested in kernels/test_kernel_guard.py)."""

from __future__ import annotations

import pytest

from glm5_matrix.engines import specs
from glm5_matrix.errors import UserError
from glm5_matrix.matrix.context import CellContext, Weights
from glm5_matrix.matrix.profiles import load_profile


def _cell(**settings) -> CellContext:
    return CellContext(
        cell="e2e-tp2",
        id="e2e-tp2(deep_gemm)",
        slug="e2e-tp2-deep_gemm",
        suite="e2e",
        env="cuda",
        profile="glm-5.3-flash-4l",
        tp=2,
        gpus=2,
        settings=settings,
        weights=Weights(kind="random"),
    )


def test_cell_engine_args_map_the_backend_axis_per_gpu_family(monkeypatch) -> None:
    profile = load_profile("glm-5.3-flash-4l")
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm100")
    args = specs.cell_engine_args(_cell(moe_backend="flashinfer"), profile)
    assert args == {"tensor_parallel_size": 2, "moe_backend": "flashinfer_trtllm"}
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm90")
    assert specs.cell_engine_args(_cell(moe_backend="flashinfer"), profile)["moe_backend"] == (
        "flashinfer_cutlass"
    )
    with pytest.raises(UserError, match="names no backend for sm80"):
        specs.moe_backend_for(profile, "deep_gemm", "sm80")
    with pytest.raises(UserError, match="has no 'cutlass'"):
        specs.moe_backend_for(profile, "cutlass", "sm90")


def test_engine_spec_uses_random_weights_and_refuses_harness_args(monkeypatch) -> None:
    profile = load_profile("glm-5.3-flash-4l")
    monkeypatch.setattr(specs, "gpu_family", lambda: "sm90")
    spec = specs.engine_spec(_cell(moe_backend="deep_gemm"), profile, max_num_seqs=8)
    assert spec.model == str(profile.directory)
    assert spec.args["load_format"] == "glm5-random"
    assert spec.args["max_num_seqs"] == 8 and spec.args["moe_backend"] == "deep_gemm"
    assert spec.label.endswith("[max_num_seqs=8]")
    profile.data["engine"]["load_format"] = "auto"
    with pytest.raises(UserError, match="'load_format' is set by the harness"):
        specs.engine_spec(_cell(), profile)


def test_jit_monitor_joins_only_where_the_guard_asks_and_the_spec_is_silent(monkeypatch) -> None:
    from glm5_matrix.kernels import kernel_guard

    asked: list[bool] = []

    def mode(enforce_eager: bool) -> str | None:
        asked.append(enforce_eager)
        return None if enforce_eager else "error"

    monkeypatch.setattr(kernel_guard, "jit_monitor_mode", mode)
    compiled = specs.EngineSpec("c", "m", {"enforce_eager": False})
    assert specs.jit_monitor_args(compiled) == {"jit_monitor_mode": "error"}
    assert specs.jit_monitor_args(specs.EngineSpec("e", "m", {"enforce_eager": True})) == {}
    mine = specs.EngineSpec("u", "m", {"enforce_eager": False, "jit_monitor_mode": "warn"})
    assert specs.jit_monitor_args(mine) == {}
    assert asked == [False, True]
