"""The ``paged-kv`` command: ``paged-kv serve`` (the OpenAI-compatible server) and ``paged-kv run`` (the main job)."""

from __future__ import annotations

import argparse
import logging
import sys

from paged_kv.errors import InvalidArgumentError, PagedKVError, describe
from scheduler.entrypoints.main_job import add_engine_options, checked_engine_config, engine_config
from scheduler.entrypoints.pinned_prompt import pin_system_prompt, read_prompt
from scheduler.entrypoints.server.config import (
    CONVERTS,
    DEFAULT_MAX_REQUEST_BYTES,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    LoRAModule,
    ServerConfig,
)


def serve_parser() -> argparse.ArgumentParser:
    """Options of ``paged-kv serve`` (vLLM's names where vLLM has the option), and the engine's options."""
    p = argparse.ArgumentParser(prog="paged-kv serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", default=None,
                   help="local transformers folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients use, the first listed first (default: --model, else the model's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests held at once (running + waiting); more get 503 with Retry-After (default 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + max_tokens of a request (default: what the model and the KV pool allow)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most log-probabilities per token a request may ask (default 20)")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="key(s) every /v1 request must send as 'Authorization: Bearer <key>' (the routes outside /v1, "
                        "/health, /metrics, /tokenize, ..., stay open; default: no key)")
    p.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; larger ones get 413 unread (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="finished /v1/responses kept for GET, DELETE and previous_response_id (least recently used "
                        "forgotten first; in memory, per process, lost at restart; 0: none kept; default 1024)")
    p.add_argument("--enable-dev-endpoints", action="store_true",
                   help="serve vLLM's development endpoints: POST /reset_prefix_cache (default off: they answer 404)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chats with a request's own chat_template (a Jinja template run on the server; "
                        "vLLM's flag); default off: such a request gets 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request gives tools): the model answers '
                        "freely and --tool-call-parser reads its tool calls (vLLM's flag); default off: such a "
                        "request gets 400")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how \"auto\" reads tool calls out of the text (vLLM's flag): hermes, <tool_call>{...}"
                        "</tool_call> tags; llama3_json, [<|python_tag|>]{\"name\": ..., \"parameters\": {...}}; ...; "
                        "pythonic, [f(a=1), g()]; mistral, [TOOL_CALLS][{\"name\": ..., \"arguments\": {...}}] or "
                        "[TOOL_CALLS]name[ARGS]{...}; qwen3_coder, <tool_call><function=name><parameter=key>value"
                        "</parameter></function></tool_call> (values typed by the tools' schemas); deepseek_v3 and "
                        "deepseek_v31, DeepSeek's <｜tool▁calls▁begin｜> blocks (V3/R1-0528's and V3.1's)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a chat answer's thinking out of its content into the message's reasoning and "
                        "reasoning_content fields (vLLM's flag): deepseek_r1 and qwen3, <think>...</think>; mistral, "
                        "[THINK]...[/THINK] (Magistral); default: no split")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='a chat request with tool_choice "none" is rendered without its tools (vLLM\'s flag); '
                        "default off: the chat template gets them whatever the tool choice")
    p.add_argument("--pin-prompt", default=None, metavar="FILE",
                   help="a system prompt (UTF-8 text file) kept on the device from start-up to shutdown: the "
                        "prefix every chat request with that system message starts with is never evicted")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="MODULE",
                   help="LoRA adapters served as models of their own (vLLM's flag; needs --enable-lora): name=path, "
                        'or JSON {"name": ..., "path": ..., "base_model_name": ...}; a request whose model is a name '
                        "runs through that adapter")
    p.add_argument("--convert", choices=CONVERTS, default="none",
                   help="embed: also serve POST /v1/embeddings (vLLM's --convert embed) from the same engine, pooled "
                        "as --pooler-config says; generation stays served (default none: no embeddings endpoint)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; needs --enable-lora); default off: they answer 404")
    add_engine_options(p)
    return p


def serve_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``paged-kv serve``, checked before the model loads (a bad one exits with a usage error);
    ``pin_prompt_text`` holds the --pin-prompt file's system prompt (or None)."""
    parser = serve_parser()
    args = parser.parse_args(argv)
    checked_engine_config(parser, args)
    try:
        config = server_config(args)  # ServerConfig checks every server option (--enable-auto-tool-choice: a parser)
        if (config.lora_modules or config.allow_runtime_lora_updating) and not args.enable_lora:
            flag = "--lora-modules" if config.lora_modules else "--allow-runtime-lora-updating"
            raise InvalidArgumentError(describe(flag, True, "used with --enable-lora"))
        args.pin_prompt_text = read_prompt(args.pin_prompt) if args.pin_prompt is not None else None
    except PagedKVError as e:
        parser.error(str(e))
    return args


def build_server(args: argparse.Namespace):
    """The loaded model (its system prompt pinned if asked) and the app serving it: ``(llm, app)``."""
    from scheduler.entrypoints.llm import LLM
    from scheduler.entrypoints.server.app import build_app

    llm = LLM(args.model, engine_config=engine_config(args))
    try:
        if args.pin_prompt_text is not None:
            pin_system_prompt(llm, args.pin_prompt_text)  # held until shutdown
        return llm, build_app(llm, server_config(args))
    except BaseException:
        llm.engine.shutdown()
        raise


def serve(argv: list[str]) -> None:
    """Load the model and serve it until interrupted."""
    import torch
    import uvicorn

    from scheduler.model.loader import load_model
    from scheduler.runner.tp_worker import is_torchrun_worker, serve_rank

    args = serve_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if is_torchrun_worker():  # torchrun rank > 0: no server, run this rank's shard for rank 0's engine
        serve_rank(load_model(args.model).hf_model, engine_config(args))
        return
    try:
        llm, app = build_server(args)
    except PagedKVError as e:  # a model path, or a system prompt shorter than a block
        serve_parser().error(str(e))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        llm.engine.shutdown()  # spills cached blocks to the disk tier, stops tensor-parallel workers


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server options of the command line; served names as vLLM's: --served-model-name, else --model."""
    names = args.served_model_name or ([args.model] if args.model else [])
    return ServerConfig(
        served_model_names=tuple(names), max_in_flight=args.max_in_flight, max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs, api_keys=tuple(args.api_key or ()), max_request_bytes=args.max_request_bytes,
        responses_store_size=args.responses_store_size,
        log_requests=not args.disable_log_requests, enable_dev_endpoints=args.enable_dev_endpoints,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser,
        lora_modules=tuple(LoRAModule.parse(m) for m in args.lora_modules or ()),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, convert=args.convert,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``paged-kv <command> ...``."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": serve, "run": _run}
    if not argv or argv[0] not in commands:
        print("usage: paged-kv {serve,run} [options]  (paged-kv serve --help)", file=sys.stderr)
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    commands[argv[0]](argv[1:])


def _run(argv: list[str]) -> None:
    from scheduler.entrypoints.main_job import main as run_main

    run_main(argv)


if __name__ == "__main__":
    main()
