"""The ``paged-kv`` command: ``paged-kv serve`` (the OpenAI-compatible server) and ``paged-kv run`` (the main job)."""

from __future__ import annotations

import argparse
import sys

from scheduler.entrypoints.main_job import add_engine_options, engine_config


def serve_parser() -> argparse.ArgumentParser:
    """Options of ``paged-kv serve``: model, address, admission limit, and the engine's options."""
    p = argparse.ArgumentParser(prog="paged-kv serve", description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", default=None,
                   help="local transformers folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="requests held at once (running + waiting); more get 503 with Retry-After")
    add_engine_options(p)
    return p


def serve(argv: list[str]) -> None:
    """Load the model and serve it until interrupted."""
    import torch
    import uvicorn

    from scheduler.entrypoints.llm import LLM
    from scheduler.entrypoints.server.app import build_app
    from scheduler.model.loader import load_model
    from scheduler.runner.tp_worker import is_torchrun_worker, serve_rank

    args = serve_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if is_torchrun_worker():  # torchrun rank > 0: no server, run this rank's shard for rank 0's engine
        serve_rank(load_model(args.model).hf_model, engine_config(args))
        return
    llm = LLM(args.model, engine_config=engine_config(args))
    names = tuple(n for n in (args.served_model_name, args.model) if n)
    app = build_app(llm, max_in_flight=args.max_in_flight, model_names=names)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        llm.engine.shutdown()  # stops tensor-parallel workers (a no-op on one rank)


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
