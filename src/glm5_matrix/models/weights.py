"""Random weights that make outputs vary, without a download: the `glm5-random` load format.

vLLM's `load_format="dummy"` fills every float tensor with uniform values in +-1e-3 (8-bit
floats in +-1) and their fp32 block scales with the same +-1e-3. Through RMSNorm weights of
1e-3 and fp8 scales of 1e-3 the residual stream carries almost nothing, and GLM-5.3-Flash-4L
then emits one token forever (40354 x 32 on an H200), so every "outputs are equal" check
would pass vacuously. This loader keeps vLLM's dummy machinery (dtype handling, devices,
quantized layers) but picks the ranges the way an initialiser would:

- norm weights 1, biases 0, except the MLA layers' query norm (`q_a_layernorm`), whose weights
  are QUERY_GAIN: sharper attention (below);
- matrices uniform in +-sqrt(3 / fan_in), so activations keep their scale layer to layer;
- fp8 matrices uniform in +-1 with their block scales set to sqrt(3 / fan_in), the same
  effective weights;
- the output head (ParallelLMHead) as a matrix whose rows are scaled by a Zipf law over a
  seeded ranking of the vocabulary (head_row_scales), so that greedy choices win by a margin;
- everything else (gates, decay parameters, integers) as vLLM's dummy loader does.

Why the head: with every row alike, the logits of GLM-5.3-Flash's 154,880 tokens are ~N(0, 1),
and the best of so many lies within one or two bf16 steps of the second best at many steps (on
the H200: the chosen logprob near -8, exact ties among the top candidates; simulated over random
unit-RMS hidden states in bf16: median margin 6 bf16 steps of the top logit, an exact tie at 7%
of the steps). Greedy output is then decided by the tie-break and by one step of noise, and every
comparison of greedy runs is weak. Rows scaled by gain * rank^-0.5 leave few tokens in
contention at each step, still depending on the state: the same simulation gives a median
margin of ~46 steps and an exact tie at ~1% of the steps, with 10-12 distinct tokens in 24.

Why the query gain: with q and k of unit scale the MLA layer's softmax over the 2048 keys its
indexer selects is nearly flat, its output the mean of thousands of random values, and the
logits depend on the last tokens and hardly on earlier ones. On the H200 a prompt whose first
4352-token block was drawn anew (what a wrong or stale cached block amounts to: the suites'
negative control) then moved the logprobs by 0.16-0.20, 1.05-1.5 times the engine's own noise
(issue 27), and changed no token. Scaling q by QUERY_GAIN makes each query attend to the few
keys it matches best, so the output depends on which earlier tokens are there.

Each tensor's seed comes from its name, so P and D instances (and repeated runs) get identical
weights. vLLM loads the format in every process through the `vllm.general_plugins` entry point
(`register` below), which the runner exposes to the cell's interpreter.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_matrix.errors import UserError
from glm5_matrix.files import write_atomic

LOAD_FORMAT = "glm5-random"
# The head's rows: gain * (1 + rank)^-exponent over a seeded ranking of the vocabulary.
HEAD_ZIPF_EXPONENT = 0.5
HEAD_GAIN = 3.0
HEAD_MODULES = ("ParallelLMHead",)
# The MLA query norm's weight (q = q_b_proj(q_a_layernorm(q_a_proj(x)))): the attention logits'
# scale, ~1 at weight 1 (see the module doc).
QUERY_GAIN = 8.0
QUERY_NORMS = ("q_a_layernorm",)
# A measurement's override of QUERY_GAIN (docs/verdicts.md, "The repeat's power"; docs/journal.md measured the repeat at
# several gains): set in the cell's environment, read in every vLLM process, recorded by the
# suites as weights.query_gain.
QUERY_GAIN_VARIABLE = "GLM5_MATRIX_QUERY_GAIN"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "glm5_matrix_random_weights"
PLUGIN_TARGET = "glm5_matrix.models.weights:register"


@dataclass(frozen=True)
class Init:
    """How one tensor is filled: a constant, a symmetric uniform range, or vLLM's default."""

    kind: str  # "constant", "uniform", "head" (uniform, rows scaled) or "vllm-default"
    value: float = 0.0  # the constant, or the half-width of the uniform range


def query_gain() -> float:
    """The MLA query norm's weight: QUERY_GAIN, or GLM5_MATRIX_QUERY_GAIN where set (a positive
    number; anything else is refused with one line)."""
    text = os.environ.get(QUERY_GAIN_VARIABLE, "").strip()
    if not text:
        return QUERY_GAIN
    try:
        gain = float(text)
    except ValueError:
        gain = math.nan
    if not (math.isfinite(gain) and gain > 0):
        raise UserError(f"{QUERY_GAIN_VARIABLE}={text!r} is not a positive number")
    return gain


def seed_for(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def choose_init(
    name: str,
    shape: tuple[int, ...],
    is_float: bool,
    bits: int,
    module_kind: str,
    sibling_shape: tuple[int, ...] | None = None,
    sibling_bits: int | None = None,
    module_name: str = "",
) -> Init:
    """The rule for one tensor. `name` is its name inside its module (`weight`,
    `w13_weight_scale_inv`), `module_kind` the module's class name, `sibling_*` describe the
    quantized tensor a scale belongs to, `module_name` the module's path in the model."""
    if not is_float:
        return Init("vllm-default")
    leaf = name.rsplit(".", 1)[-1]
    if "scale" in leaf:
        if sibling_shape and sibling_bits is not None and sibling_bits <= 8:
            return Init("constant", math.sqrt(3.0 / sibling_shape[-1]))
        return Init("vllm-default")
    if leaf == "bias":
        return Init("constant", 0.0)
    if "norm" in module_kind.lower() and leaf == "weight" and len(shape) == 1:
        if module_name.rsplit(".", 1)[-1] in QUERY_NORMS:
            return Init("constant", query_gain())
        return Init("constant", 1.0)
    if module_kind in HEAD_MODULES and leaf == "weight" and len(shape) == 2 and bits > 8:
        return Init("head", math.sqrt(3.0 / shape[-1]))
    if len(shape) >= 2 and shape[-1] > 0:
        if bits <= 8:
            return Init("uniform", 1.0)
        return Init("uniform", math.sqrt(3.0 / shape[-1]))
    return Init("vllm-default")


def head_row_scales(
    total: int,
    seed: int,
    exponent: float = HEAD_ZIPF_EXPONENT,
    gain: float = HEAD_GAIN,
) -> Any:
    """The per-row scale of an output head of `total` rows: gain * (1 + rank)^-exponent, the
    ranks a permutation of the rows drawn with `seed` (a float32 numpy array). The same in
    every process and for every tensor-parallel shard, which slices its rows out of it."""
    import numpy as np

    ranks = np.empty(total, dtype=np.float64)
    ranks[np.random.default_rng(seed).permutation(total)] = np.arange(total, dtype=np.float64)
    return (gain * (1.0 + ranks) ** -exponent).astype(np.float32)


def scale_sibling(name: str) -> str | None:
    """`w13_weight_scale_inv` -> `w13_weight`; `weight_scale` -> `weight`."""
    for suffix in ("_scale_inv", "_scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def register() -> None:
    """vllm.general_plugins entry point: runs in every vLLM process before models load."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())


def _loader_class() -> Any:
    import torch
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    def bits_of(tensor: torch.Tensor) -> int:
        if tensor.dtype.is_floating_point:
            return torch.finfo(tensor.dtype).bits
        return tensor.element_size() * 8

    class RandomWeightsLoader(DummyModelLoader):
        """DummyModelLoader with ranges that keep activations alive (see the module doc)."""

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            # Online-quantized layers go through vLLM's own path (they are materialized and
            # quantized there); GLM-5.3-Flash's checkpoint is pre-quantized, so none are.
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
            from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

            for prefix, layer in model.named_modules():
                info = get_layerwise_info(layer)
                if info.can_load():
                    self._process_online_quant_layer(layer, info)
                    continue
                tensors = {
                    name: tensor
                    for name, tensor in get_layer_tensors(layer).items()
                    if name not in layer._non_persistent_buffers_set
                }
                for name, tensor in tensors.items():
                    sibling = tensors.get(scale_sibling(name) or "")
                    rule = choose_init(
                        name,
                        tuple(tensor.shape),
                        tensor.dtype.is_floating_point,
                        bits_of(tensor),
                        type(layer).__name__,
                        tuple(sibling.shape) if sibling is not None else None,
                        bits_of(sibling) if sibling is not None else None,
                        module_name=prefix,
                    )
                    seed = seed_for(f"{prefix}.{name}")
                    if rule.kind == "constant":
                        with torch.no_grad():
                            tensor.fill_(rule.value)
                    elif rule.kind in ("uniform", "head"):
                        initialize_single_dummy_weight(
                            tensor, low=-rule.value, high=rule.value, seed=seed
                        )
                        if rule.kind == "head":
                            _scale_head_rows(layer, tensor, seed)
                    else:
                        initialize_single_dummy_weight(tensor, seed=seed)

    def _scale_head_rows(layer: torch.nn.Module, tensor: torch.Tensor, seed: int) -> None:
        """Scale this shard's rows of a vocab-parallel head by head_row_scales over the whole
        (padded) vocabulary: shard r of n holds rows [r * rows, (r + 1) * rows)."""
        rows = tensor.shape[0]
        rank, size = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
        scales = torch.from_numpy(
            head_row_scales(rows * size, seed)[rank * rows : (rank + 1) * rows]
        )
        with torch.no_grad():
            tensor.mul_(scales.to(device=tensor.device, dtype=tensor.dtype)[:, None])

    return RandomWeightsLoader


def entry_points_text() -> str:
    """The entry_points.txt that makes vLLM load this plugin."""
    return f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n"


def write_plugin_site(directory: Path) -> Path:
    """A site directory holding only this plugin's distribution metadata. On PYTHONPATH (with
    src/), every vLLM process of the cell finds the entry point: in a uv venv and in an
    offline interpreter alike, without installing anything."""
    info = directory / "glm5_matrix_plugins-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": "Metadata-Version: 2.1\nName: glm5-matrix-plugins\nVersion: 0.1.0\n",
        "entry_points.txt": entry_points_text(),
    }
    for name, text in files.items():
        write_atomic(info / name, text)
    return directory
