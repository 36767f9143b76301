"""The glm5-random load format: the init rules, and the entry point vLLM discovers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from glm5_matrix.weights import LOAD_FORMAT, choose_init, scale_sibling, seed_for, write_plugin_site


def test_norm_weights_are_one_and_biases_zero():
    assert choose_init("weight", (4096,), True, 16, "RMSNorm").value == 1.0
    assert choose_init("weight", (4096,), True, 16, "GemmaRMSNorm").value == 1.0
    assert choose_init("bias", (4096,), True, 16, "ColumnParallelLinear").value == 0.0


def test_matrices_keep_activation_scale():
    rule = choose_init("weight", (12288, 4096), True, 16, "MergedColumnParallelLinear")
    assert rule.kind == "uniform"
    # Uniform(-a, a) has variance a^2 / 3; fan-in scaling wants 1 / fan_in.
    assert rule.value**2 / 3 == pytest.approx(1 / 4096)


def test_fp8_weight_and_its_block_scale_give_the_same_effective_weights():
    weight = choose_init("w13_weight", (288, 4096, 4096), True, 8, "FusedMoE")
    scale = choose_init(
        "w13_weight_scale_inv", (288, 32, 32), True, 32, "FusedMoE", (288, 4096, 4096), 8
    )
    assert weight == type(weight)("uniform", 1.0)
    assert scale.kind == "constant"
    effective_variance = (weight.value**2 / 3) * scale.value**2
    assert effective_variance == pytest.approx(1 / 4096)


def test_everything_else_is_left_to_vllm():
    assert choose_init("A_log", (64,), True, 32, "KimiDeltaAttention").kind == "vllm-default"
    assert choose_init("dt_bias", (64,), True, 32, "KimiDeltaAttention").kind == "vllm-default"
    assert choose_init("positions", (8,), False, 64, "Rotary").kind == "vllm-default"
    # A scale whose tensor is not 8-bit is not a block scale of a quantized matrix.
    scale = choose_init("k_scale", (), True, 32, "Attention", (128, 128), 16)
    assert scale.kind == "vllm-default"


def test_scale_siblings_and_seeds():
    assert scale_sibling("weight_scale_inv") == "weight"
    assert scale_sibling("w2_weight_scale") == "w2_weight"
    assert scale_sibling("weight") is None
    assert seed_for("model.layers.0.mlp") == seed_for("model.layers.0.mlp")
    assert seed_for("model.layers.0.mlp") != seed_for("model.layers.1.mlp")


def test_plugin_site_exposes_the_entry_point_vllm_loads(tmp_path):
    site = write_plugin_site(tmp_path / "site")
    code = (
        "import json, importlib.metadata as m;"
        "print(json.dumps([(e.name, e.value) for e in m.entry_points(group='vllm.general_plugins')]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    found = dict(json.loads(out.stdout))
    assert found.get("glm5_matrix_random_weights") == "glm5_matrix.weights:register"
    assert LOAD_FORMAT == "glm5-random"


def test_ranges_are_finite_for_every_real_width():
    for fan_in in (1, 128, 512, 1536, 4096, 12288):
        assert math.isfinite(choose_init("weight", (8, fan_in), True, 16, "Linear").value)
