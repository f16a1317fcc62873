"""The ``paged-kv`` command line: subcommands, ``serve``'s server flags (vLLM's names) and the engine options."""

from __future__ import annotations

import argparse

import pytest
import torch

from paged_kv.errors import InvalidArgumentError
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolerConfig
from scheduler.entrypoints.cli import main, serve_args, serve_parser, server_config
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.main_job import KV_CACHE_DTYPES, engine_config, main_job_parser, parse_args
from scheduler.entrypoints.server.config import ServerConfig


def test_serve_takes_the_engine_options_of_the_main_job():
    args = serve_parser().parse_args(["--port", "9001", "--kv-blocks", "64", "--block-size", "8",
                                      "--preemption-mode", "swap", "--max-num-seqs", "4"])  # fmt: skip
    assert (args.host, args.port, args.model) == ("127.0.0.1", 9001, None)
    config = engine_config(args)
    assert (config.cache.num_gpu_blocks, config.cache.block_size, config.cache.num_cpu_blocks) == (64, 8, 128)
    assert (config.scheduler.preemption_mode, config.scheduler.max_num_seqs) == ("swap", 4)
    assert engine_config(parse_args(["--kv-blocks", "64", "--block-size", "8", "--preemption-mode", "swap",
                                      "--max-num-seqs", "4"])) == config  # fmt: skip


def test_scheduling_policy_option():
    assert engine_config(parse_args([])).scheduler.scheduling_policy == "fcfs"
    args = serve_parser().parse_args(["--scheduling-policy", "priority"])
    assert engine_config(args).scheduler.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--scheduling-policy", "lifo"])


@pytest.mark.parametrize("parser", [serve_parser, main_job_parser])
def test_every_option_with_a_default_names_it_in_its_help(parser):
    for action in parser()._actions:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:  # none, a switch
            continue
        assert f"default {action.default}" in (action.help or ""), f"{action.option_strings}: {action.help!r}"


def test_trust_request_chat_template_is_off_unless_asked_and_its_help_says_so():
    (action,) = [a for a in serve_parser()._actions if "--trust-request-chat-template" in a.option_strings]
    assert action.default is False and "default off" in action.help
    assert not server_config(serve_parser().parse_args([])).trust_request_chat_template


def test_auto_tool_choice_flags_reach_the_server_config_and_need_each_other(capsys):
    assert not server_config(serve_args([])).enable_auto_tool_choice
    config = server_config(serve_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")
    with pytest.raises(SystemExit):
        serve_args(["--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic", "mistral"])
def test_each_tool_call_parser_reaches_the_server_config_and_its_help_names_it(parser):
    config = server_config(serve_args(["--enable-auto-tool-choice", "--tool-call-parser", parser]))
    assert config.tool_call_parser == parser
    (action,) = [a for a in serve_parser()._actions if "--tool-call-parser" in a.option_strings]
    assert f"{parser}, " in action.help


def test_an_unknown_tool_call_parser_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as info:
        serve_args(["--enable-auto-tool-choice", "--tool-call-parser", "granite"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--tool-call-parser" in err and "'granite'" in err


def test_reasoning_parser_reaches_the_server_config_and_an_unknown_one_is_refused_naming_the_flag(capsys):
    assert server_config(serve_args([])).reasoning_parser is None
    assert server_config(serve_args(["--reasoning-parser", "qwen3"])).reasoning_parser == "qwen3"
    assert server_config(serve_args(["--reasoning-parser", "mistral"])).reasoning_parser == "mistral"
    with pytest.raises(SystemExit):
        serve_args(["--reasoning-parser", "granite"])
    assert "--reasoning-parser" in capsys.readouterr().err


@pytest.mark.parametrize(("kw", "name"), [({"enable_auto_tool_choice": True}, "enable_auto_tool_choice"),
                                          ({"tool_call_parser": "granite"}, "tool_call_parser"),
                                          ({"enable_auto_tool_choice": 1, "tool_call_parser": "hermes"},
                                           "enable_auto_tool_choice")])  # fmt: skip
def test_bad_tool_options_are_typed_errors_naming_them(kw, name):
    with pytest.raises(InvalidArgumentError, match=f"^{name}="):
        ServerConfig(**kw)


@pytest.mark.parametrize(("argv", "code"), [([], 2), (["nope"], 2), (["--help"], 0)])
def test_unknown_or_missing_subcommands_print_usage(argv, code, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == code and "paged-kv {serve,run}" in capsys.readouterr().err


def test_serve_takes_vllms_server_flags():
    args = serve_parser().parse_args([
        "--model", "/models/tiny", "--served-model-name", "a", "b", "--max-model-len", "100", "--max-logprobs", "5",
        "--api-key", "k1", "k2", "--disable-log-requests", "--max-request-bytes", "1000", "--max-in-flight", "8",
        "--enable-dev-endpoints", "--trust-request-chat-template", "--exclude-tools-when-tool-choice-none",
        "--responses-store-size", "7",
    ])  # fmt: skip
    assert server_config(args) == ServerConfig(
        served_model_names=("a", "b"), max_model_len=100, max_logprobs=5, api_keys=("k1", "k2"), log_requests=False,
        max_request_bytes=1000, max_in_flight=8, enable_dev_endpoints=True, trust_request_chat_template=True,
        exclude_tools_when_tool_choice_none=True, responses_store_size=7,
    )  # fmt: skip
    default = server_config(serve_parser().parse_args(["--model", "/models/tiny"]))
    assert default == ServerConfig(served_model_names=("/models/tiny",))  # vLLM: the --model argument
    assert server_config(serve_parser().parse_args([])).served_model_names == ()  # the bundled model's own name


@pytest.mark.parametrize(("name", "dtype"), [("auto", torch.float32), ("int8", torch.int8),
                                             ("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                             ("fp8_e5m2", torch.float8_e5m2)])  # fmt: skip
def test_kv_cache_dtype_maps_to_the_page_storage_and_the_engine_runs_with_it(tiny_model_dir, name, dtype):
    args = serve_parser().parse_args(["--kv-cache-dtype", name, "--device", "cpu", "--kv-blocks", "64",
                                      "--block-size", "4"])  # fmt: skip
    assert engine_config(args).cache.dtype == KV_CACHE_DTYPES[name]
    llm = LLM(tiny_model_dir, engine_config=engine_config(args))
    assert llm.engine.runner.gpu_cache.spec.dtype == dtype
    (out,) = llm.generate("hello world", SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--kv-cache-dtype", "fp4"])


@pytest.mark.parametrize("make_args", [parse_args, serve_args], ids=["run", "serve"])
def test_speculative_config_flag_reaches_the_engine_config(make_args):
    assert engine_config(make_args([])).speculative_config is None
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    spec = engine_config(make_args(["--speculative-config", flag])).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.min_n, spec.max_n) == ("ngram", 3, 2, 4)


@pytest.mark.parametrize("flag, field", [
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"), ('{"method": "medusa", "num_speculative_tokens": 2}',
    "method"), ("not json", "speculative_config"), ('{"num_speculative_tokens": 2, "draft": 1}', "draft"),
])  # fmt: skip
@pytest.mark.parametrize("make_args", [parse_args, serve_args], ids=["run", "serve"])
def test_a_bad_speculative_config_is_a_usage_error_naming_the_flag_and_field(make_args, flag, field, capsys):
    with pytest.raises(SystemExit) as info:
        make_args(["--speculative-config", flag])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--speculative-config: {field}=" in err


def test_main_job_lora_modules_need_enable_lora_and_distinct_names(capsys):
    """--lora-modules without --enable-lora, a bad entry or a repeated name is a usage error naming the flag."""
    for argv, words in ((["--lora-modules", "a=/p"], "--enable-lora"),
                        (["--enable-lora", "--lora-modules", "nopath"], "lora_modules"),
                        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "distinct")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err
        assert "lora-modules" in err.replace("_", "-") and words in err
    from scheduler import LoRARequest

    args = parse_args(["--enable-lora", "--lora-modules", "a=/p", '{"name": "b", "path": "/q"}'])
    assert args.lora_requests == [LoRARequest(name="a", path="/p"), LoRARequest(name="b", path="/q")]
    assert parse_args([]).lora_requests == []


def test_main_job_deals_the_workload_round_robin_over_the_base_model_and_the_adapters(tiny_hf, tmp_path):
    """workload_loras: base, a, b, base, ...; serve runs each request through its adapter, all to the end."""
    from lora_helpers import write_adapter
    from sched_helpers import make_engine

    from scheduler import LoRAConfig, LoRARequest
    from scheduler.entrypoints.main_job import serve, workload_loras
    from scheduler.entrypoints.workload import ChatRequest

    a, b = (LoRARequest(name=n, path=write_adapter(tmp_path / n, tiny_hf, seed=i)) for i, n in enumerate("ab"))
    loras = workload_loras(5, [a, b])
    assert loras == [None, a, b, None, a] and workload_loras(2, []) == [None, None]
    engine = make_engine(tiny_hf, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    requests = [ChatRequest(f"r{i}", [], [1 + i, 2, 3], params) for i in range(5)]
    seen, add = {}, engine.add_request
    engine.add_request = lambda rid, *a, **kw: seen.setdefault(rid, add(rid, *a, **kw).lora)
    done = serve(engine, requests, 2, loras)
    assert sorted(done) == [r.request_id for r in requests]
    ran = [seen[r.request_id] for r in requests]
    assert [(k.name, k.path) if k else None for k in ran] == [(x.name, x.path) if x else None for x in loras]


def test_convert_embed_and_pooler_config_reach_the_configs_and_bad_ones_are_usage_errors(capsys):
    args = serve_args(["--convert", "embed", "--pooler-config",
                       '{"pooling_type": "MEAN", "normalize": false, "is_matryoshka": true, '
                       '"matryoshka_dimensions": [32, 64]}'])  # fmt: skip
    assert server_config(args).convert == "embed" and server_config(serve_args([])).convert == "none"
    assert engine_config(args).pooler_config == PoolerConfig(pooling_type="MEAN", normalize=False, is_matryoshka=True,
                                                            matryoshka_dimensions=(32, 64))  # fmt: skip
    assert engine_config(serve_args([])).pooler_config is None  # absent: the checkpoint's, else the defaults
    assert engine_config(serve_args(["--pooler-config", "{}"])).pooler_config == PoolerConfig()  # explicit
    for bad, named in (('{"pooling_type": "CLS"}', "pooling_type"), ('{"dims": 3}', "dims"), ("[1]", "text")):
        with pytest.raises(SystemExit):
            serve_args(["--pooler-config", bad])
        err = capsys.readouterr().err
        assert "--pooler-config" in err and named in err
    with pytest.raises(SystemExit):
        serve_args(["--convert", "classify"])
    assert "--convert" in capsys.readouterr().err
