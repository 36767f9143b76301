"""Prefill/decode disaggregation (1P1D) over two vLLM API servers, without a proxy.

The request flow is the one of vLLM's toy P/D proxy, done by the client itself:
1. prefill on P: the prompt with max_tokens=1 and kv_transfer_params={"do_remote_decode": true};
   P computes the prompt's KV, keeps its blocks for D and answers with kv_transfer_params
   (P's engine id, side-channel address, block ids per KV group);
2. decode on D: the same prompt with those kv_transfer_params; D's NixlConnector pulls the
   blocks from P over NIXL instead of computing the prompt, then generates.

Prompts are token ids (the tiny models have no tokenizer); the answers carry token ids
(`return_token_ids`) and each sampled token's logprob. The Prometheus /metrics text of each
server tells what crossed: bytes moved by NIXL, external prefix-cache hits, prompt tokens by
source.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Metric names as exported by vLLM (counters gain `_total`, histograms `_sum`/`_count`):
# vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py and vllm/v1/metrics/loggers.py.
NIXL_BYTES = "vllm:nixl_bytes_transferred"
NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
# On P: read notifications for a request whose KV lease had expired (P had released its blocks).
# vLLM only logs such a read and D answers 200 with whatever the blocks hold by then: the
# reproduction for vLLM's maintainers, with the blocks reused so that D's tokens show it, is
# LATE_READ_REPRODUCTION.
NIXL_NOTIFS_AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry_total"
LATE_READ_REPRODUCTION = "upstream/nixl-read-after-lease-expiry"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
EXTERNAL_SOURCE = "external_kv_transfer"
REQUEST_TIMEOUT = 120.0

_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class RequestFailed(RuntimeError):
    """A server answered a completion request with an HTTP error."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


# What D's worker logs when its NIXL handshake with P timed out (vLLM 0.32 and 0.33,
# nixl/base_worker.py): a handshake failure record, and ZMQ's receive timeout as its exception
# (D waits 5 s, hard-coded, for P's metadata; a thread of P's engine core answers).
_HANDSHAKE_FAILURE = "NIXL transfer failure: handshake"
_ZMQ_TIMEOUT = "zmq.error.Again"


def handshake_timed_out(logged_errors: Sequence[str]) -> bool:
    """Whether D's ERROR records (servers.logged_errors) say its NIXL handshake with P timed out:
    a failure to reach P in time, unlike a handshake P refused (compatibility hash mismatch)."""
    return any(_HANDSHAKE_FAILURE in line for line in logged_errors) and any(
        _ZMQ_TIMEOUT in line for line in logged_errors
    )


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the sampled token's logprob at each step
    top_logprobs: list[dict[int, float]]  # per step: the top candidates (when asked for)
    kv_transfer_params: dict[str, Any] | None
    cached_tokens: int | None  # usage.prompt_tokens_details, when the server reports it


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class TransferCounters:
    """What one server's /metrics says about KV that came from elsewhere, or went out."""

    nixl_bytes: float  # sum of vllm:nixl_bytes_transferred (on the side that read)
    nixl_transfers: float  # count of that histogram
    nixl_failed: float
    external_hits: float  # tokens served from the connector (D side)
    external_queries: float
    local_hits: float  # tokens served from the server's own prefix cache
    external_prompt_tokens: float  # vllm:prompt_tokens_by_source{source="external_kv_transfer"}

    def minus(self, before: TransferCounters) -> TransferCounters:
        return TransferCounters(
            *(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__)
        )


def parse_metrics(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments and blank lines skipped)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        labels = {
            key: value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            for key, value in _LABEL.findall(match.group("labels") or "")
        }
        samples.append(Sample(match.group("name"), labels, _to_float(match.group("value"))))
    return samples


def _to_float(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    return special[text] if text in special else float(text)


def metric_sum(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """Sum of `name` over all samples whose labels include `labels` (0 when absent)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def transfer_counters(samples: Sequence[Sample]) -> TransferCounters:
    return TransferCounters(
        nixl_bytes=metric_sum(samples, NIXL_BYTES + "_sum"),
        nixl_transfers=metric_sum(samples, NIXL_BYTES + "_count"),
        nixl_failed=metric_sum(samples, NIXL_FAILED_TRANSFERS),
        external_hits=metric_sum(samples, EXTERNAL_HITS),
        external_queries=metric_sum(samples, EXTERNAL_QUERIES),
        local_hits=metric_sum(samples, LOCAL_HITS),
        external_prompt_tokens=metric_sum(samples, PROMPT_TOKENS_BY_SOURCE, source=EXTERNAL_SOURCE),
    )


def cache_config(samples: Sequence[Sample]) -> dict[str, str]:
    """The labels of vllm:cache_config_info (the engine's CacheConfig, values as strings)."""
    for sample in samples:
        if sample.name == CACHE_CONFIG_INFO:
            return dict(sample.labels)
    raise ValueError(f"no {CACHE_CONFIG_INFO} in the metrics")


def fetch_metrics(base_url: str) -> list[Sample]:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        return parse_metrics(response.read().decode())


def complete(
    base_url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    timeout: float = REQUEST_TIMEOUT,
    top_logprobs: int = 0,
    logit_bias: Mapping[int, float] | None = None,
) -> Completion:
    """Greedy completion of a token-id prompt, with token ids and per-token logprobs back
    (and the `top_logprobs` best candidates of each step when > 0); `logit_bias` steers it
    (a control taking a runner-up)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # fixed length: random weights may emit EOS anywhere
        "logprobs": top_logprobs,  # the sampled token's logprob, plus this many candidates
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # no tokenizer: tokens print as "token_id:N"
        "stream": False,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if logit_bias:
        body["logit_bias"] = {str(token): float(bias) for token, bias in logit_bias.items()}
    url = base_url + "/v1/completions"
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RequestFailed(url, exc.code, exc.read().decode(errors="replace")) from None
    return _completion(answer)


def _completion(answer: Mapping[str, Any]) -> Completion:
    choice = answer["choices"][0]
    token_ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    if len(logprobs) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs in {choice}")
    top = [
        {_token_id(token): float(value) for token, value in (step or {}).items()}
        for step in choice["logprobs"].get("top_logprobs") or []
    ]
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprobs=top,
        kv_transfer_params=answer.get("kv_transfer_params"),
        cached_tokens=details.get("cached_tokens"),
    )


def _token_id(token: str) -> int:
    """A token printed by return_tokens_as_token_ids ("token_id:42") as its id."""
    prefix = "token_id:"
    if not token.startswith(prefix):
        raise ValueError(f"token {token!r} is not in the {prefix}N form")
    return int(token[len(prefix) :])


@dataclass(frozen=True)
class Disaggregated:
    prefill: Completion  # P's answer: one token and the kv_transfer_params for D
    decode: Completion  # D's answer: the whole output, computed on P's KV


def prefill_then_decode(
    prefill_url: str,
    decode_url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    timeout: float = REQUEST_TIMEOUT,
    top_logprobs: int = 0,
) -> Disaggregated:
    """One request through P then D (what vLLM's toy P/D proxy does)."""
    prefill = complete(
        prefill_url,
        model,
        prompt,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
        timeout=timeout,
    )
    params = prefill.kv_transfer_params
    if not params or not params.get("remote_block_ids"):
        raise ValueError(f"{prefill_url}: prefill answered without KV to hand over: {params!r}")
    decode = complete(
        decode_url,
        model,
        prompt,
        max_tokens,
        kv_transfer_params=params,
        timeout=timeout,
        top_logprobs=top_logprobs,
    )
    return Disaggregated(prefill=prefill, decode=decode)
