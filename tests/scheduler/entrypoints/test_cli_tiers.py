"""The command line's tier, KV-event and pinned-prompt flags: what they configure, and a usage error for bad values."""

from __future__ import annotations

import httpx
import pytest

from paged_kv.config import DISK_REFRESH_INTERVAL_S
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.core.params import SamplingParams
from scheduler.entrypoints.cli import build_server, serve_args
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.main_job import engine_config, parse_args
from scheduler.entrypoints.pinned_prompt import system_prefix
from scheduler.entrypoints.server.background import serve_in_thread
from scheduler.entrypoints.tier_options import tier_summary

GIB = 1 << 30
SYSTEM = "the quick brown fox jumps over the lazy dog. " * 4


def test_tier_flags_set_the_cache_config_alike_for_serve_and_run(tmp_path):
    argv = ["--kv-offloading-size", "0.5", "--kv-offloading-policy", "write", "--kv-disk-dir", str(tmp_path),
            "--kv-disk-size", "2", "--kv-disk-refresh-interval", "0.5"]  # fmt: skip
    cache = engine_config(serve_args(argv)).cache
    assert (cache.kv_offloading_bytes, cache.host_store) == (GIB // 2, "write")
    assert (cache.kv_disk_dir, cache.kv_disk_bytes, cache.kv_disk_refresh_interval_s) == (str(tmp_path), 2 * GIB, 0.5)
    assert engine_config(parse_args(argv)) == engine_config(serve_args(argv))
    never = engine_config(parse_args([*argv[:-1], "0"])).cache
    assert never.kv_disk_refresh_interval_s == 0.0  # only at start-up
    assert engine_config(parse_args(argv[:-2])).cache.kv_disk_refresh_interval_s == DISK_REFRESH_INTERVAL_S


def test_without_tier_flags_the_engine_config_is_unchanged():
    config = engine_config(parse_args([]))
    assert (config.cache.kv_offloading_bytes, config.cache.kv_disk_dir, config.kv_events) == (0, None, None)
    assert serve_args([]).pin_prompt_text is None


def test_kv_events_from_vllms_json_and_the_short_endpoint_flag():
    as_json = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv", "hwm": 10}'
    config = engine_config(parse_args(["--kv-events-config", as_json])).kv_events
    assert config == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", topic="kv", hwm=10)
    short = engine_config(parse_args(["--kv-events-endpoint", "ipc:///tmp/kv"])).kv_events
    assert short == KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/kv")
    both = ["--kv-events-config", '{"topic": "kv"}', "--kv-events-endpoint", "tcp://10.0.0.1:6000"]
    merged = engine_config(parse_args(both)).kv_events
    assert (merged.enable_kv_cache_events, merged.endpoint, merged.topic) == (True, "tcp://10.0.0.1:6000", "kv")


def _bad(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    d = str(tmp_path)
    return [
        (["--kv-offloading-size", "-1"], "--kv-offloading-size"), (["--kv-offloading-size", "lots"], "GiB"),
        (["--kv-offloading-size", "nan"], "--kv-offloading-size"), (["--kv-offloading-policy", "lru"], "evict"),
        (["--kv-offloading-size", "2000000"], "kv_offloading_bytes"),  # 2 PiB: a unit mistake
        (["--kv-disk-dir", d], "--kv-disk-size"), (["--kv-disk-size", "1"], "--kv-disk-dir"),
        (["--kv-disk-dir", d, "--kv-disk-size", "1"], "--kv-offloading-size"),
        (["--kv-offloading-size", "1", "--no-prefix-caching"], "--no-prefix-caching"),
        (["--kv-offloading-size", "1", "--tensor-parallel-size", "2"], "tensor_parallel_size"),
        (["--kv-events-config", "{bad"], "JSON object"), (["--kv-events-config", "[1]"], "JSON object"),
        (["--kv-events-config", '{"enable": true}'], "unknown field"),
        (["--kv-events-config", '{"endpoint": "http://x"}'], "endpoint"),
        (["--kv-events-config", '{"hwm": -1}'], "hwm"),
        (["--kv-events-endpoint", "localhost:5557"], "--kv-events-endpoint"),
        (["--pin-prompt", str(tmp_path / "missing.txt")], "--pin-prompt"), (["--pin-prompt", str(empty)], "empty"),
        (["--kv-disk-refresh-interval", "-1"], "--kv-disk-refresh-interval"),
        (["--kv-disk-refresh-interval", "inf"], "--kv-disk-refresh-interval"),
        (["--kv-disk-refresh-interval", "often"], "--kv-disk-refresh-interval"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(21))
def test_bad_tier_values_are_usage_errors_naming_the_flag(tmp_path, capsys, case):
    argv, named = _bad(tmp_path)[case]
    parsers = [serve_args] if argv[0] == "--pin-prompt" else [serve_args, parse_args]
    for parse in parsers:
        with pytest.raises(SystemExit) as info:
            parse(argv)
        assert info.value.code == 2 and named in capsys.readouterr().err, (parse, argv)


def test_the_flags_build_an_engine_with_its_tiers_and_events(tiny_model_dir, tmp_path):
    args = serve_args(["--device", "cpu", "--kv-blocks", "16", "--block-size", "4", "--kv-offloading-size", "0.001",
                       "--kv-disk-dir", str(tmp_path), "--kv-disk-size", "0.01",
                       "--kv-events-endpoint", "tcp://127.0.0.1:*"])  # fmt: skip
    llm = LLM(tiny_model_dir, engine_config=engine_config(args))
    try:
        assert llm.engine.tiers.host_cache.nbytes <= GIB // 1000 < llm.engine.tiers.host_cache.nbytes * 2
        assert llm.engine.tiers.disk is not None and llm.engine.cache_events is not None
    finally:
        llm.engine.shutdown()


def test_the_main_jobs_summary_gives_each_tiers_hits_traffic_and_occupancy(tiny_model_dir, tmp_path):
    args = parse_args(["--device", "cpu", "--kv-blocks", "24", "--block-size", "4", "--kv-offloading-size",
                       str(64 / 1024**2), "--kv-disk-dir", str(tmp_path), "--kv-disk-size", str(1 / 1024)])  # fmt: skip
    llm = LLM(tiny_model_dir, engine_config=engine_config(args))
    for first in (220, 221, 222, 223, 220):  # the last comes back from the host tier
        llm.generate([[first] + list(range(3, 42))], SamplingParams(max_tokens=2))
    llm.engine.tiers.disk.flush()
    stats, t = llm.engine.block_manager.stats(), llm.engine.tiers.stats()
    hits, traffic, held = tier_summary(llm.engine).splitlines()
    device = stats.num_hit_tokens - t.host_hit_tokens - t.disk_hit_tokens
    assert t.host_hit_tokens > 0 and t.disk_bytes_written > 0
    assert hits == (f"prefix-cache hits by tier: device {device} tokens, host {t.host_hit_tokens}, "
                    f"disk {t.disk_hit_tokens}")
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    assert traffic == (f"tier traffic: device->host {mib(t.bytes_stored)}, host->device {mib(t.bytes_loaded)}; "
                       f"disk written {mib(t.disk_bytes_written)}, read {mib(t.disk_bytes_read)}")  # fmt: skip
    share = f"{t.host_cached_blocks / t.host_blocks:.0%}"
    assert held.startswith(f"tier occupancy: host {t.host_cached_blocks} of 32 blocks cached ({share}); disk ")
    assert held.endswith(f"of {mib(1 << 20)} ({t.disk_bytes_used / (1 << 20):.0%})")
    llm.engine.shutdown()
    plain = LLM(tiny_model_dir, engine_config=engine_config(parse_args(["--device", "cpu"])))
    assert tier_summary(plain.engine) is None


def test_the_pinned_system_prompt_is_what_a_chat_request_starts_with_and_stays_cached(tiny_model_dir, tmp_path):
    prompt = tmp_path / "system.txt"
    prompt.write_text(SYSTEM + "\n")
    args = serve_args(["--model", str(tiny_model_dir), "--device", "cpu", "--kv-blocks", "64", "--block-size", "4",
                       "--pin-prompt", str(prompt)])  # fmt: skip
    llm, app = build_server(args)
    prefix = system_prefix(llm, SYSTEM)
    chat = llm.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}])
    assert chat[: len(prefix)] == prefix and len(prefix) > len(llm.encode(SYSTEM)[0])  # the template's tokens too
    defaults = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
                "chat_template_kwargs": {}, "chat_template": None}  # fmt: skip
    assert llm.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}],
                           **defaults) == chat  # fmt: skip
    other = llm.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "paris"}])
    assert other[: len(prefix)] == prefix and other[len(prefix)] != chat[len(prefix)]  # the user's words start there
    (held,) = llm.engine.pins.held.values()
    assert held == len(prefix) // 4 * 4
    assert app.state.frontend.max_model_len == 64 * 4 + 1  # sharing the pinned blocks: all of them, +1 (last token)
    with serve_in_thread(app) as url:
        for i in range(4):  # prompts that need every block the pin leaves
            body = {"prompt": list(range(10 + i, 110 + i)), "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}],
                "max_tokens": 2}  # fmt: skip
        usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        unread = {**body, "chat_template_kwargs": {"enable_thinking": False},  # a variable the template ignores
                  "messages": [body["messages"][0], {"role": "user", "content": "paris"}]}  # fmt: skip
        unread = httpx.post(f"{url}/v1/chat/completions", json=unread, timeout=60).json()["usage"]
        body["messages"][1]["content"] = "hello there, " * 12  # with the system prompt: past what the pin leaves
        long_chat = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        apart = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(50, 210)), "max_tokens": 2}, timeout=60)
    assert usage["prompt_tokens_details"]["cached_tokens"] == held
    assert unread["prompt_tokens_details"]["cached_tokens"] == held  # the same rendering: the same pinned hit
    assert long_chat["prompt_tokens"] + 2 > (64 - held // 4) * 4  # fits: the pinned blocks are its own
    assert long_chat["prompt_tokens_details"]["cached_tokens"] >= held
    assert apart.status_code == 400 and apart.json()["error"]["param"] == "max_tokens"  # 160 tokens beside the pin: no
    llm.engine.shutdown()
