"""/metrics under vLLM's names and meanings: exact values for a known workload, and every series vLLM's dashboard reads.

The server steps 32 tokens at most, so the long prompt below is prefilled in chunks.
"""

from __future__ import annotations

import time
import uuid

import openai
from server_helpers import hold_steps, scrape

from scheduler.core.params import SamplingParams

LONG = "the quick brown fox jumps over the lazy dog, " * 3
# the series the panels and the model_name variable of vLLM's Grafana dashboard query (both versions of
# examples/online_serving/prometheus_grafana/grafana.json stored), each with {model_name="$model_name"}
DASHBOARD = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_swapped", "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
]  # fmt: skip
# the rest of vLLM's metrics this server exposes (vllm/v1/metrics/loggers.py)
MORE = [
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:iteration_tokens_total_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_inference_time_seconds_sum", "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket",
]  # fmt: skip


def _value(samples: dict, served, name: str, **labels) -> float:
    """One series of the served model (vLLM's labels model_name and engine="0")."""
    labels |= {"model_name": served.llm.model_name, "engine": "0"}
    return samples[(name, tuple(sorted(labels.items())))]


def test_every_series_the_dashboard_reads_is_there_with_its_labels(served_chunked):
    samples = scrape(served_chunked)
    model = served_chunked.llm.model_name
    for name in DASHBOARD + MORE:
        found = [dict(labels) for n, labels in samples if n == name]
        assert found and all(f["model_name"] == model for f in found), name
        assert not name.endswith("_bucket") or all("le" in f for f in found), name
    reasons = {dict(labels)["finished_reason"] for n, labels in samples if n == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}
    assert all(dict(labels).get("model_name") == model for n, labels in samples if n.startswith("vllm:"))


def test_a_known_workload_gives_exact_counts(served_chunked, offline):
    served, salt = served_chunked, uuid.uuid4().hex  # a salt of its own: no hit from any other request
    (full,) = offline.generate("hello world", SamplingParams(max_tokens=24, ignore_eos=True))
    text = full.outputs[0].text
    k = next(i for i in range(3, len(text) - 2) if text.find(text[i : i + 2]) == i and text[i : i + 2].strip())
    prompt_len = {p: len(offline.encode(p)[0]) for p in (LONG, "hello there", "hello world")}
    before = scrape(served)
    with openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0) as client:
        kw = dict(model=served.llm.model_name, temperature=0, extra_body={"ignore_eos": True, "cache_salt": salt})
        chunks = list(client.completions.create(prompt=LONG, max_tokens=6, stream=True, **kw))
        assert chunks[-1].choices[0].finish_reason == "length"
        client.completions.create(prompt=LONG, max_tokens=3, **kw)  # its prompt's whole blocks are cached now
        three = client.completions.create(prompt="hello there", max_tokens=4, n=3, seed=7, **{**kw, "temperature": 1})
        assert [c.finish_reason for c in three.choices] == ["length"] * 3
        stopped = client.completions.create(prompt="hello world", max_tokens=24, stop=[text[k : k + 2]], **kw)
        assert stopped.choices[0].finish_reason == "stop"
    after = scrape(served)

    def delta(name: str, **labels) -> float:
        return _value(after, served, name, **labels) - _value(before, served, name, **labels)

    stop_tokens = stopped.usage.completion_tokens
    samples = [6, 3, 4, 4, 4, stop_tokens]  # tokens of each sample
    prompts = [prompt_len[LONG], prompt_len[LONG], prompt_len["hello there"], prompt_len["hello world"]]
    hits = (prompt_len[LONG] - 1) // 4 * 4  # the second LONG finds every whole block but the one of its last token
    assert delta("vllm:prompt_tokens_total") == sum(prompts)
    assert delta("vllm:generation_tokens_total") == sum(samples)
    assert delta("vllm:request_success_total", finished_reason="length") == 5
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    for name in ("vllm:time_per_output_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert delta(name) == sum(t - 1 for t in samples)  # one per output token after each sample's first
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time"):  # fmt: skip
        assert delta(f"vllm:{name}_seconds_count") == 4, name
    assert delta("vllm:request_prompt_tokens_sum") == sum(prompts)
    assert (delta("vllm:request_generation_tokens_sum"), delta("vllm:request_generation_tokens_count")) == (
        sum(samples), 6)
    assert delta("vllm:request_max_num_generation_tokens_sum") == 6 + 3 + 4 + stop_tokens
    assert delta("vllm:request_params_n_sum") == 6 and delta("vllm:request_params_max_tokens_sum") == 6 + 3 + 4 + 24
    assert delta("vllm:prefix_cache_queries_total") == sum(prompts)  # each prompt once, though prefilled in chunks
    assert delta("vllm:prefix_cache_hits_total") == hits
    assert delta("vllm:iteration_tokens_total_sum") == sum(prompts) - hits + sum(t - 1 for t in samples)
    assert delta("vllm:num_preemptions_total") == 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc"):  # fmt: skip
        assert _value(after, served, gauge) == 0, gauge
    queries, hits = (_value(after, served, f"vllm:prefix_cache_{x}_total") for x in ("queries", "hits"))
    assert after[("paged_kv:prefix_cache_hit_rate", ())] == hits / queries


def test_a_client_that_leaves_counts_its_samples_as_aborted(served_chunked, monkeypatch):
    served = served_chunked
    hold_steps(served, monkeypatch)  # its samples are still running when the client leaves
    before = scrape(served)
    with openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0) as client:
        stream = client.completions.create(model=served.llm.model_name, prompt="hello", max_tokens=400, n=2,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        stream.close()

    def aborted(samples: dict) -> float:
        return _value(samples, served, "vllm:request_success_total", finished_reason="abort")

    deadline = time.monotonic() + 20
    while aborted(after := scrape(served)) < aborted(before) + 2:  # the engine thread counts it after the abort
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.02)
    assert aborted(after) == aborted(before) + 2 and not served.llm.engine.has_unfinished_requests()
    e2e = [_value(s, served, "vllm:e2e_request_latency_seconds_count") for s in (before, after)]
    assert e2e[0] == e2e[1]  # an aborted request is not observed in the request histograms
