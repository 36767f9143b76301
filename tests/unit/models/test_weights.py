"""The glm5-random load format: the init rules, and the entry point vLLM discovers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from glm5_matrix.errors import UserError
from glm5_matrix.models.weights import (
    HEAD_GAIN,
    HEAD_ZIPF_EXPONENT,
    LOAD_FORMAT,
    QUERY_GAIN,
    QUERY_GAIN_VARIABLE,
    choose_init,
    head_row_scales,
    scale_sibling,
    seed_for,
    write_plugin_site,
)


def test_norm_weights_are_one_and_biases_zero():
    assert choose_init("weight", (4096,), True, 16, "RMSNorm").value == 1.0
    assert choose_init("weight", (4096,), True, 16, "GemmaRMSNorm").value == 1.0
    assert choose_init("bias", (4096,), True, 16, "ColumnParallelLinear").value == 0.0


def test_mla_query_norm_sharpens_attention():
    """Only the MLA query norm gets the gain: the KV latent's norm and the layer norms stay 1."""
    query = choose_init(
        "weight", (1536,), True, 16, "RMSNorm", module_name="model.layers.3.self_attn.q_a_layernorm"
    )
    assert query.kind == "constant" and query.value == QUERY_GAIN > 1
    for other in ("model.layers.3.self_attn.kv_a_layernorm", "model.layers.3.input_layernorm"):
        assert choose_init("weight", (512,), True, 16, "RMSNorm", module_name=other).value == 1.0


def test_query_gain_override(monkeypatch):
    """A measurement sets the gain through the environment; a value that is no positive number
    is one clear error, not a silently different model."""
    name = "model.layers.3.self_attn.q_a_layernorm"
    monkeypatch.setenv(QUERY_GAIN_VARIABLE, "2.5")
    assert choose_init("weight", (1536,), True, 16, "RMSNorm", module_name=name).value == 2.5
    monkeypatch.setenv(QUERY_GAIN_VARIABLE, "")
    assert choose_init("weight", (1536,), True, 16, "RMSNorm", module_name=name).value == QUERY_GAIN
    for bad in ("0", "-1", "nan", "inf", "eight"):
        monkeypatch.setenv(QUERY_GAIN_VARIABLE, bad)
        with pytest.raises(UserError, match=QUERY_GAIN_VARIABLE):
            choose_init("weight", (1536,), True, 16, "RMSNorm", module_name=name)


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
    assert found.get("glm5_matrix_random_weights") == "glm5_matrix.models.weights:register"
    assert LOAD_FORMAT == "glm5-random"


def test_ranges_are_finite_for_every_real_width():
    for fan_in in (1, 128, 512, 1536, 4096, 12288):
        assert math.isfinite(choose_init("weight", (8, fan_in), True, 16, "Linear").value)


def test_the_output_head_gets_scaled_rows():
    rule = choose_init("weight", (154880, 4096), True, 16, "ParallelLMHead")
    assert rule.kind == "head" and rule.value**2 / 3 == pytest.approx(1 / 4096)
    # The input embedding is no head; a quantized head keeps vLLM's rule for fp8 matrices.
    assert choose_init("weight", (154880, 4096), True, 16, "VocabParallelEmbedding").kind == (
        "uniform"
    )
    assert choose_init("weight", (154880, 4096), True, 8, "ParallelLMHead").kind == "uniform"


def test_head_row_scales_are_a_seeded_zipf_law():
    scales = head_row_scales(1000, seed=7)
    assert scales.shape == (1000,)
    assert sorted(scales.tolist(), reverse=True)[:3] == pytest.approx(
        [HEAD_GAIN, HEAD_GAIN * 2**-HEAD_ZIPF_EXPONENT, HEAD_GAIN * 3**-HEAD_ZIPF_EXPONENT]
    )
    assert (head_row_scales(1000, seed=7) == scales).all()
    assert not (head_row_scales(1000, seed=8) == scales).all()
    # Shards slice one law over the whole head: two halves are the first 500 rows and the rest.
    assert (head_row_scales(1000, seed=7)[500:] == scales[500:]).all()


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (to nearest, ties to even), as the head's GEMM output."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.view(np.float32)


def _margins_in_steps(head: np.ndarray, steps: int, seed: int) -> np.ndarray:
    """Greedy margins (best logit minus second best, in bf16 steps of the best) of `head` over
    random unit-RMS hidden states, rounded to bf16 as the model's final norm output is."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((steps, head.shape[1])).astype(np.float32)
    hidden = _bf16(hidden / np.sqrt((hidden**2).mean(axis=1, keepdims=True)))
    logits = _bf16(hidden @ head.T)
    top2 = -np.sort(-logits, axis=1)[:, :2]
    step = 2.0 ** (np.floor(np.log2(np.abs(top2[:, 0]))) - 7)
    return (top2[:, 0] - top2[:, 1]) / step


def test_scaled_rows_make_greedy_choices_win_by_a_margin():
    """The head rule against a plain uniform head, simulated: the plain head's best logit is
    within one bf16 step of the second at many steps; the scaled one's margins are far wider.
    A smaller stand-in for GLM's 154,880 x 4096 head: 20,000 x 512, which gives the same
    statistics (they depend on the vocabulary's size only through log(vocab))."""
    vocab, hidden = 20000, 512
    bound = math.sqrt(3.0 / hidden)
    plain = np.random.default_rng(0).uniform(-bound, bound, (vocab, hidden)).astype(np.float32)
    scaled = plain * head_row_scales(vocab, seed=1)[:, None]
    flat, sharp = _margins_in_steps(plain, 300, 2), _margins_in_steps(scaled, 300, 2)
    assert np.median(flat) < 12 and (flat < 1).mean() > 0.03
    assert np.median(sharp) > 30 and (sharp < 1).mean() < 0.02
