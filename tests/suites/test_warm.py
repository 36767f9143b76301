"""The warm-up (`nox -s warm -- CELL...`): every distinct engine (or server) configuration of
the cell's suite is started once and sent the requests of the profile's [warm] table, so that
what the cell compiles lands in the kernel cache before the cell runs with the guard on.

The configurations come from glm5_matrix.engines.engine_configs, the functions the suites build their
engines with; one already warmed in this warm run (by an earlier cell) is not started again.
Per prompt of [warm]: a greedy request with top logprobs, a one-token request without them that
starts from the prefix cache, and after a prefix-cache reset the first again steered off its
first token (logit_bias, as the suites' runner-up controls); then a reset that waits for offload
stores and the longest prompt again, which an offload connector serves from the CPU side.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from glm5_matrix.engines import disagg, engine_configs, servers
from glm5_matrix.engines.client import Engine
from glm5_matrix.engines.engine_configs import Config, ServerSpec, WarmLedger, warm_prompts
from glm5_matrix.engines.prompts import random_prompt
from glm5_matrix.engines.specs import EngineSpec
from glm5_matrix.kernels import kernel_cache
from glm5_matrix.matrix.context import CellContext
from glm5_matrix.matrix.profiles import Profile
from glm5_matrix.results.recorder import record_figure
from glm5_matrix.verdicts import judging

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_surviving_children")]

TOP_LOGPROBS = judging.TOP_LOGPROBS  # what the suites ask for
SEED = 7
STORE_WAIT_S = 120.0
REQUEST_TIMEOUT_S = 300.0


def _block_size(layout: dict) -> int:
    """The block size of the prefix-cacheable groups (GLM's tail ring has its own)."""
    return max(g["block_size"] for g in layout["groups"] if g.get("prefix_cacheable", True))


def _record_request_compiles(label: str, before: kernel_cache.Snapshot) -> None:
    """What the warm requests compiled after the start (kernels built at first use of a shape):
    per library, files written."""
    changed = kernel_cache.written(before, kernel_cache.snapshot())
    counts = {name: len(paths) for name, paths in sorted(changed.items()) if paths}
    print(f"{label}: the warm requests compiled {counts or 'nothing'}")
    record_figure(f"warm.requests_compiled[{label}]", counts, unit="files")


def _warm_engine(spec: EngineSpec, profile: Profile) -> tuple[str, float, int]:
    """Start the engine, send the warm requests, stop it: (the label its start was recorded
    under, seconds of requests, requests)."""
    with Engine(spec) as engine:
        print(f"{spec.label} up in {engine.start_seconds:.1f} s")
        before = kernel_cache.snapshot()
        started = time.monotonic()
        prompts = warm_prompts(profile, _block_size(engine.kv_layout()))
        for length, max_tokens in prompts:
            prompt = engine.random_prompt(length, SEED)
            first = engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS)
            engine.generate_greedy(prompt, 1)
            engine.reset_prefix_cache_when_stored(STORE_WAIT_S)
            # The suites steer only engines without a drafter (vLLM 0.33 refuses logit_bias
            # with speculative decoding: seen on the H200, where it failed the warm step).
            if "speculative_config" not in spec.args:
                bias = {first.token_ids[0]: -100.0}
                engine.generate_scored(prompt, max_tokens, TOP_LOGPROBS, logit_bias=bias)
        engine.reset_prefix_cache_when_stored(STORE_WAIT_S)
        longest = max(length for length, _ in prompts)
        engine.generate_greedy(engine.random_prompt(longest, SEED), 1)
        seconds = time.monotonic() - started
        _record_request_compiles(spec.label, before)
    assert not engine.leftover_processes, engine.leftover_processes
    return spec.label, seconds, 3 * len(prompts) + 1


def _warm_server(spec: ServerSpec, profile: Profile, log_dir: Path) -> tuple[str, float, int]:
    """Start the server, send the warm requests over HTTP, stop it."""
    server = servers.VllmServer(
        spec.label,
        spec.model,
        spec.args,
        env=spec.environment,
        log_dir=log_dir,
        python=sys.executable,
        startup_timeout=spec.startup_timeout_s,
    )
    config = json.loads((Path(spec.model) / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    with server:
        before = kernel_cache.snapshot()
        started = time.monotonic()
        block = int(disagg.cache_config(disagg.fetch_metrics(server.url))["block_size"])
        prompts = warm_prompts(profile, block)
        for length, max_tokens in prompts:
            prompt = random_prompt(vocab, length, SEED)
            for tokens, top in ((max_tokens, TOP_LOGPROBS), (1, 0)):
                disagg.complete(
                    server.url,
                    engine_configs.SERVED_MODEL,
                    prompt,
                    tokens,
                    timeout=REQUEST_TIMEOUT_S,
                    top_logprobs=top,
                )
        seconds = time.monotonic() - started
        _record_request_compiles(f"server:{spec.label}", before)
    assert server.group_members_left() == [], "the warm server left processes behind"
    return f"server:{spec.label}", seconds, 2 * len(prompts)


def _warm(config: Config, profile: Profile, log_dir: Path) -> tuple[str, float, int]:
    if isinstance(config, ServerSpec):
        return _warm_server(config, profile, log_dir)
    return _warm_engine(config, profile)


def test_warm(
    cell: CellContext, profile: Profile, tmp_path_factory: pytest.TempPathFactory
) -> None:
    configs = engine_configs.for_cell(cell, profile)
    ledger = WarmLedger.from_environment()
    log_dir = Path(cell.results_dir) if cell.results_dir else tmp_path_factory.mktemp("warm")
    for config in configs:
        key = engine_configs.config_key(config)
        earlier = ledger.warmed_by(key) if ledger else None
        if earlier is not None:
            print(f"{config.label}: warmed already in this run ({earlier})")
            record_figure("warm.deduplicated", f"{config.label} (warmed by {earlier})")
            continue
        label, seconds, requests = _warm(config, profile, log_dir)
        print(f"{label}: {requests} warm requests in {seconds:.1f} s")
        record_figure(f"warm.requests_s[{label}]", round(seconds, 2), unit="s")
        if ledger is not None:
            ledger.add(key, f"{cell.id} {config.label}")
