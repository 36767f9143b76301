"""Hand-made greedy outputs (compare.GreedyOutput) for the unit tests of glm5_matrix.verdicts.compare and
glm5_matrix.verdicts.judging: per-step logits on the bf16 grid, scored as vLLM scores a greedy run."""

from __future__ import annotations

import math
import random

from glm5_matrix.verdicts import compare

STEP = 2.0**-5  # one bf16 step of logits in [4, 8)


def scored(tokens: list[int], top: list[dict[int, float]]) -> compare.GreedyOutput:
    return compare.GreedyOutput(tokens, [step[t] for t, step in zip(tokens, top, strict=True)], top)


def bf16_logits(rng: random.Random, vocab: int, spread: float) -> list[float]:
    """Logits as a bf16 engine makes them: values in [4, 8) on the grid of one bf16 step."""
    return [4.0 + round(rng.uniform(0.0, spread) / STEP) * STEP for _ in range(vocab)]


def greedy(logits_per_step: list[list[float]], top: int = 5) -> compare.GreedyOutput:
    """A greedy output with top-`top` logprobs from per-step logits (ties to the lower id)."""
    tokens, tops = [], []
    for logits in logits_per_step:
        lse = math.log(math.fsum(math.exp(v) for v in logits))
        order = sorted(range(len(logits)), key=lambda t: (-logits[t], t))
        tokens.append(order[0])
        tops.append({t: logits[t] - lse for t in order[:top]})
    return scored(tokens, tops)


def model_logits(
    seed: int, steps: int = 12, vocab: int = 64, lead: float = 1.0
) -> list[list[float]]:
    """Per-step logits of a fixed 'model' (seed), on the bf16 grid, with clear winners (one
    token raised by `lead`)."""
    model = random.Random(seed)
    out = []
    for _ in range(steps):
        logits = bf16_logits(model, vocab, 2.5)
        logits[model.randrange(vocab)] += lead  # a clear winner
        out.append(logits)
    return out


# A model whose winners lead by at least 1.5 (48 steps): nudges of up to 40 steps keep its tokens.
DECISIVE = 4.0


def nudged(logits: list[list[float]], steps: int, every: int = 3) -> list[list[float]]:
    """The same logits with every `every`-th token's logit moved up by `steps` bf16 steps: what
    a rerun of the request does to some logits on the GPU (one or two steps)."""
    return [
        [v + steps * STEP if t % every == 0 else v for t, v in enumerate(row)] for row in logits
    ]
