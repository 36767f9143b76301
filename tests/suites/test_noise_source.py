"""Where the engine's own noise comes from (issue 27, point 4): the same request twice on the same
engine, every module call traced (glm5_matrix.engines.worker_trace: digests of each call's inputs and
output, in the worker), and the first call at which the two runs part (glm5_matrix.verdicts.divergence).

On vLLM's CPU build the two runs are bitwise equal and the trace shows no divergence; on an H200
the logits differ by a bf16 step or two, and the trace names the module where that starts. The
instrument is checked on every run: a third run with one bit flipped in one module call's output
must part from the first exactly there. Then vLLM's batch-invariant mode
(`VLLM_BATCH_INVARIANT=1`): where every attention backend the engine uses declares support, it
must make the two runs bitwise equal (what the mode promises); where one does not, vLLM refuses
the mode for this model and the test says which backends.

Runs in eager mode only (the profile's enforce_eager): forward hooks do not fire inside
torch.compile'd graphs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from glm5_matrix.engines.client import Engine, block_size_of, resolve_class
from glm5_matrix.engines.engine_configs import noise_specs
from glm5_matrix.engines.worker_trace import worker_start_trace, worker_stop_trace
from glm5_matrix.engines.workers import worker_attention_backends
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.results.recorder import record_figure
from glm5_matrix.verdicts import compare, divergence, judging

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

TOP_LOGPROBS = judging.TOP_LOGPROBS


def _noise(profile: Profile) -> dict[str, Any]:
    return dict(profile.section("noise"))


@pytest.fixture(scope="module")
def engine(cell: CellContext, profile: Profile) -> Iterator[Engine]:
    with Engine(noise_specs(cell, profile)[0]) as running:
        if running.spec.args.get("enforce_eager") is not True:
            pytest.fail(f"{running.spec.label}: the trace needs enforce_eager (forward hooks)")
        yield running


def _prompt(engine: Engine, profile: Profile, block: int) -> list[int]:
    noise = _noise(profile)
    length = round(float(noise["prompt_blocks"]) * block)
    return engine.random_prompt(length, int(profile.section("prompts")["seed"]))


def _traced(
    engine: Engine, prompt: list[int], max_tokens: int, plant: list[Any] | None = None
) -> tuple[compare.GreedyOutput, list[dict[str, Any]]]:
    """One greedy request from an empty prefix cache, every module call traced."""
    assert engine.reset_prefix_cache(), "reset_prefix_cache() refused"
    hooked = engine.rpc(worker_start_trace, plant)[0]
    try:
        output = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
    finally:
        trace = engine.rpc(worker_stop_trace)[0]
    assert hooked > 0 and trace, f"{hooked} modules hooked, {len(trace)} calls traced"
    assert output.cached_tokens == 0, f"{output.cached_tokens} prompt tokens came from the cache"
    return output, trace


def _bitwise(a: compare.GreedyOutput, b: compare.GreedyOutput) -> bool:
    try:
        compare.check_exact(a, b, ("first", "second"))
    except AssertionError:
        return False
    return True


def test_where_identical_runs_part(engine: Engine, profile: Profile) -> None:
    noise = _noise(profile)
    prompt = _prompt(engine, profile, block_size_of(engine.kv_layout()))
    max_tokens = int(noise["max_tokens"])
    first, trace_a = _traced(engine, prompt, max_tokens)
    second, trace_b = _traced(engine, prompt, max_tokens)
    record_figure("noise.traced_calls", len(trace_a), unit="calls")
    deltas = compare.step_deltas(first, second, len(first.token_ids))
    record_figure("noise.worst_delta", max(deltas), unit="logprob")
    found = divergence.first_divergence(trace_a, trace_b)
    equal = _bitwise(first, second)
    print(
        f"{len(prompt)} prompt tokens, {max_tokens} tokens, {len(trace_a)} module calls; "
        f"outputs {'bitwise equal' if equal else f'differ by up to {max(deltas):.4g}'}"
    )
    if found is None:
        record_figure("noise.first_divergence", None)
        print("the two traces are equal call for call")
        # No module call differed: then neither may the outputs (the logits come out of them).
        assert equal, (
            f"the outputs differ (worst {max(deltas):.4g}) but no module call did: the noise "
            "comes from outside the model's modules"
        )
    else:
        print(f"the runs part at {found.describe()}")
        record_figure("noise.first_divergence", dataclasses.asdict(found))
        record_figure("noise.first_divergence_index", found.index, unit="call")

    # The instrument's control: one bit flipped in one call's output, in the middle of the
    # model, must part the traces there and nowhere earlier.
    site = divergence.plant_site(trace_a, str(noise["plant_within"]))
    _, planted = _traced(engine, prompt, max_tokens, plant=list(site))
    caught = divergence.first_divergence(trace_a, planted)
    assert caught is not None, f"a bit flipped at {site} left the trace unchanged"
    print(f"planted at {site}: caught at {caught.describe()}")
    record_figure("noise.planted_at", list(site))
    record_figure("noise.planted_caught_at", [caught.module, caught.call, caught.index])
    assert (caught.module, caught.call) == site and caught.inputs_equal, (
        f"a bit flipped at {site} was found at {caught.describe()}"
    )
    if found is not None:
        # The natural divergence cannot come later than a planted one proves it would be seen.
        assert found.index <= caught.index + caught.later_differing + 1, (found, caught)


def test_batch_invariant_mode(cell: CellContext, profile: Profile, engine: Engine) -> None:
    """vLLM's batch-invariant mode promises bitwise-equal outputs for the same request; it is
    only allowed where every attention backend the model uses declares support."""
    backends = sorted(set(engine.rpc(worker_attention_backends)[0].values()))
    unsupported = [b for b in backends if not resolve_class(b).supports_batch_invariance()]
    record_figure("noise.batch_invariant_unsupported", unsupported)
    if unsupported:
        names = ", ".join(b.rsplit(".", 1)[-1] for b in unsupported)
        pytest.skip(
            f"vLLM refuses VLLM_BATCH_INVARIANT=1 for this model: {names} "
            "declare(s) no batch-invariant support (supports_batch_invariance() is False)"
        )
    noise = _noise(profile)
    spec = noise_specs(cell, profile)[1]
    engine.shutdown()  # one engine on the device at a time
    with Engine(spec) as invariant:
        prompt = _prompt(invariant, profile, block_size_of(invariant.kv_layout()))
        runs = []
        for _ in range(2):  # each from an empty prefix cache, as the traced runs
            assert invariant.reset_prefix_cache(), "reset_prefix_cache() refused"
            runs.append(invariant.generate_scored(prompt, int(noise["max_tokens"]), TOP_LOGPROBS))
        steps = compare.check_exact(runs[0], runs[1], ("first", "second"))
        record_figure("noise.batch_invariant_bitwise_steps", steps, unit="steps")
