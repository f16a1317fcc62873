"""The main job: SmolLM2 served by the continuous-batching engine over a mixed chat workload.

Requests arrive a few per step while others decode, half of them behind a long
shared system prompt (prefix caching); answers are streamed through the loop
with a progress bar, then a few are printed with the run's metrics and a beam
search example with the KV memory its shared blocks saved.

With ``--enable-lora --lora-modules name=path ...`` (vLLM's flags) the adapters are loaded before
the workload runs and its requests are dealt round-robin over the base model and the adapters
(request 0 the base model, request 1 the first adapter, ...), so they batch together.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from paged_kv.errors import InvalidArgumentError, PagedKVError, describe
from scheduler.core.config import (
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
)
from scheduler.core.lora_request import LoRARequest
from scheduler.core.outputs import RequestOutput
from scheduler.core.pooling_params import PoolerConfig
from scheduler.core.speculative_config import SpeculativeConfig
from scheduler.engine.llm_engine import LLMEngine
from scheduler.engine.spec_decode import SpecDecodeStats
from scheduler.entrypoints.server.config import LoRAModule
from scheduler.entrypoints.tier_options import add_tier_options, kv_events, tier_fields, tier_summary
from scheduler.entrypoints.workload import ChatRequest, chat_workload
from scheduler.model.loader import load_smollm2
from scheduler.runner.tp_worker import is_torchrun_worker, serve_rank

T = TypeVar("T")

# vLLM's --kv-cache-dtype names -> CacheConfig.dtype (None: the model's dtype); fp8 is e4m3, as in vLLM
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the main job."""
    p = main_job_parser()
    args = p.parse_args(argv)
    checked_engine_config(p, args)
    args.lora_requests = checked_lora_modules(p, args)
    return args


def checked_lora_modules(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[LoRARequest]:
    """The ``--lora-modules`` adapters as requests, or the parser's usage error (a bad entry, no --enable-lora)."""
    try:
        modules = [LoRAModule.parse(m) for m in args.lora_modules or ()]
        if modules and not args.enable_lora:
            raise InvalidArgumentError(describe("--lora-modules", True, "used with --enable-lora"))
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(describe("--lora-modules", names, "distinct adapter names"))
    except PagedKVError as e:
        parser.error(str(e))
    return [m.request for m in modules]


def workload_loras(num_requests: int, adapters: list[LoRARequest]) -> list[LoRARequest | None]:
    """Each request's adapter: round-robin over the base model (None) and ``adapters``, the base model first."""
    cycle = [None, *adapters]
    return [cycle[i % len(cycle)] for i in range(num_requests)]


def main_job_parser() -> argparse.ArgumentParser:
    """The main job's parser: its workload options and the engine's."""
    p = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=24, help="chat requests in the workload (default 24)")
    p.add_argument("--max-tokens", type=int, default=48,
                   help="longest answer; each request draws its own limit (default 48)")
    p.add_argument("--arrivals-per-step", type=int, default=2,
                   help="requests that join per engine step (default 2; 0: all at once)")
    p.add_argument("--show", type=int, default=3, help="answers to print (default 3)")
    p.add_argument("--beam-width", type=int, default=4,
                   help="beam width of the beam-search example (default 4; 0: skip it)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (vLLM's flag; needs --enable-lora): name=path or JSON {\"name\", \"path\"}; "
                        "the workload's requests go round-robin over the base model and these; default none")
    add_engine_options(p)
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    return p


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's options (KV pool and its tiers, budgets, preemption, device, threads, KV events), shared with
    ``paged-kv serve``."""
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                   help="a preempted request's KV is freed and recomputed later (recompute) or swapped out to "
                        "the CPU pool (swap); default recompute")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="serve requests by arrival (fcfs), or by (priority, arrival) with the least important, "
                        "latest running request preempted first (priority; vLLM's); default fcfs")
    p.add_argument("--kv-blocks", type=int, default=128, help="GPU KV pool size in blocks (the KV budget; default 128)")
    p.add_argument("--cpu-blocks", type=int, default=None,
                   help="CPU swap pool in blocks (default: 2x kv-blocks with swap, else 0)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                   help="KV page storage: auto (the model's dtype; default auto), or int8 / fp8 (e4m3, e5m2) codes "
                        "with scales")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--max-batched-tokens", type=int, default=256,
                   help="new tokens per step (prefill chunks + decodes; default 256)")
    p.add_argument("--no-prefix-caching", action="store_true", help="recompute shared prompt prefixes")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly, no CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: share of the GPU's memory the engine may use; sizes the KV pool (overrides --kv-blocks)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split over: local worker processes, or torchrun's WORLD_SIZE (default 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: small decode matmuls gain little from more, "
                        "and lose badly when the cores are shared; 0: torch's default)")  # fmt: skip
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding with n-gram drafts (vLLM\'s flag), e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\'; '
                        "default off")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters (vLLM's flag): requests through different adapters and the base "
                        "model batch together; default off")
    p.add_argument("--max-loras", type=int, default=1,
                   help="with --enable-lora: distinct adapters in one step (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="with --enable-lora: the largest adapter rank served (slots are padded to it; default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="with --enable-lora: adapters kept loaded in host memory, least recently used dropped "
                        "(default: --max-loras)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how embedding requests are pooled (vLLM\'s flag), e.g. \'{"pooling_type": "LAST", '
                        '"normalize": true, "is_matryoshka": true, "matryoshka_dimensions": [64, 128]}\'; '
                        "pooling_type LAST or MEAN; default: the checkpoint's sentence-transformers files if it "
                        "has them, else LAST, normalized, no Matryoshka; given (even '{}'), it wins over the "
                        "checkpoint's")
    add_tier_options(p)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration of the command line's pool and budgets."""
    cpu_blocks = args.cpu_blocks
    if cpu_blocks is None:
        cpu_blocks = 2 * args.kv_blocks if args.preemption_mode == "swap" else 0
    cache = CacheConfig(
        block_size=args.block_size, num_gpu_blocks=args.kv_blocks, num_cpu_blocks=cpu_blocks,
        enable_prefix_caching=not args.no_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=KV_CACHE_DTYPES[args.kv_cache_dtype], **tier_fields(args),
    )  # fmt: skip
    sched = SchedulerConfig(
        max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs,
        preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
    )  # fmt: skip
    return EngineConfig(
        cache=cache, scheduler=sched, device=args.device, enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size, kv_events=kv_events(args),
        speculative_config=speculative_config(args.speculative_config), lora_config=lora_config(args),
        pooler_config=pooler_config(args.pooler_config),
    )  # fmt: skip


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The LoRA options (None without --enable-lora; the other LoRA options then must keep their defaults)."""
    if args.enable_lora:
        return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
    changed = next((f for f, default in (("max_loras", 1), ("max_lora_rank", 16), ("max_cpu_loras", None))
                    if getattr(args, f) != default), None)  # fmt: skip
    if changed is not None:
        raise InvalidArgumentError(describe(f"--{changed.replace('_', '-')}", getattr(args, changed),
                                            "its default without --enable-lora"))
    return None


def speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The ``--speculative-config`` JSON as a config (None: off); a bad one raises naming the flag and the field."""
    return _json_flag("--speculative-config", SpeculativeConfig.from_json, text)


def pooler_config(text: str | None) -> PoolerConfig | None:
    """``--pooler-config`` as EngineConfig's field (absent: None, the checkpoint's pooling, else the defaults; given,
    even ``{}``, it wins over the checkpoint's); a bad one raises naming the flag and the field."""
    return _json_flag("--pooler-config", PoolerConfig.from_json, text)


def _json_flag(flag: str, from_json: Callable[[str], T], text: str | None) -> T | None:
    """A JSON flag's config (None when absent); a bad one raises its typed error prefixed with the flag."""
    if text is None:
        return None
    try:
        return from_json(text)
    except PagedKVError as e:
        raise type(e)(f"{flag}: {e}") from e


def checked_engine_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """:func:`engine_config`, or the parser's usage error (exit status 2) with the typed error's message."""
    try:
        return engine_config(args)
    except PagedKVError as e:
        parser.error(str(e))


def build_engine(hf_model, args: argparse.Namespace) -> LLMEngine:
    """The engine over SmolLM2's weights with the command line's pool and budgets."""
    return LLMEngine.from_hf(hf_model, engine_config(args))


def serve(engine: LLMEngine, requests: list[ChatRequest], arrivals_per_step: int,
          loras: list[LoRARequest | None] | None = None) -> dict[str, RequestOutput]:  # fmt: skip
    """Stream the requests into the running loop (each through its adapter in ``loras``, if given); return every
    finished output by request id."""
    pending, done = list(zip(requests, loras or [None] * len(requests))), {}
    stats = engine.block_manager.stats
    with tqdm(total=len(requests), desc="serving", unit="req") as bar:
        while pending or engine.has_unfinished_requests():
            for r, lora in pending[: arrivals_per_step or len(pending)]:
                engine.add_request(r.request_id, r.prompt_token_ids, r.params, lora_request=lora)
            del pending[: arrivals_per_step or len(pending)]
            for out in engine.step():
                done[out.request_id] = out
                bar.update(1)
            s = engine.scheduler
            bar.set_postfix(running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
                            kv=f"{stats().usage:.0%}")  # fmt: skip
    return done


def print_answers(tokenizer, requests: list[ChatRequest], done: dict[str, RequestOutput], count: int,
                  loras: list[LoRARequest | None]) -> None:  # fmt: skip
    """A few questions with their decoded answers (and the adapter each ran through)."""
    for r, lora in list(zip(requests, loras))[:count]:
        out = done[r.request_id].outputs[0]
        answer = tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
        system = "long shared system prompt" if r.messages[0]["role"] == "system" else "default system prompt"
        through = f", adapter {lora.name}" if lora is not None else ""
        print(f"\n[{r.request_id}, {system}{through}, {len(r.prompt_token_ids)} prompt tokens, {out.finish_reason}]")
        print(f"Q: {r.messages[-1]['content']}\nA: {answer}")


def beam_example(engine: LLMEngine, tokenizer, width: int, max_tokens: int) -> None:
    """One beam search on the same engine; prints the best hypothesis and the KV memory sharing saved."""
    try:
        from scheduler.engine.beam_search import BeamSearch, BeamSearchParams
    except ImportError as e:  # built separately; the serving demo does not depend on it
        print(f"\n(beam search example skipped: {e})")
        return
    messages = [{"role": "user", "content": "Give me one sentence about the ocean."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    start = time.perf_counter()
    (out,) = BeamSearch(engine).generate([ids], BeamSearchParams(width=width, max_tokens=max_tokens))
    best, mem = out.hypotheses[0], out.memory
    print(f"\nbeam search (width {width}, {time.perf_counter() - start:.1f} s): "
          f"{tokenizer.decode(best.token_ids, skip_special_tokens=True).strip()!r}")  # fmt: skip
    print(f"  KV blocks at peak: {mem.peak_blocks} shared vs {mem.peak_blocks_unshared} unshared "
          f"({mem.saving:.0%} saved; {mem.mean_saving:.0%} averaged over steps)")  # fmt: skip


def spec_summary(stats: SpecDecodeStats) -> str:
    """Speculative decoding's figures: drafts run and accepted, the acceptance rate and by position."""
    per_pos = ", ".join(f"{n / stats.num_drafts:.0%}" for n in stats.accepted_per_pos) if stats.num_drafts else "-"
    return (f"speculative decoding: {stats.num_accepted_tokens} of {stats.num_draft_tokens} draft tokens accepted "
            f"({stats.acceptance_rate:.0%}) in {stats.num_drafts} drafts; accepted by position: {per_pos}")


def main(argv: list[str] | None = None) -> None:
    """Run the main job."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    hf_model, tokenizer = load_smollm2()
    if is_torchrun_worker():  # torchrun rank > 0: serve rank 0's steps until it stops
        serve_rank(hf_model, engine_config(args))
        return
    engine = build_engine(hf_model, args)
    del hf_model
    pool = engine.runner.gpu_cache
    print(f"SmolLM2-135M-Instruct on {engine.device} (loaded in {time.perf_counter() - start:.1f} s); KV pool "
          f"{pool.num_blocks} blocks x {pool.block_size} tokens = {pool.nbytes / 2**20:.0f} MiB")  # fmt: skip
    for adapter in args.lora_requests:  # a bad one stops the job before the workload, naming it
        try:
            engine.load_lora(adapter)
        except PagedKVError as e:
            engine.shutdown()
            raise SystemExit(f"--lora-modules {adapter.name}={adapter.path}: {e}") from e
    requests = chat_workload(tokenizer, args.num_requests, args.max_tokens, seed=args.seed)
    loras = workload_loras(len(requests), args.lora_requests)
    done = serve(engine, requests, args.arrivals_per_step, loras)
    print_answers(tokenizer, requests, done, args.show, loras)
    print("\n" + engine.metrics_summary().format())
    tiers = tier_summary(engine)
    if tiers is not None:
        print(tiers)
    if engine.spec is not None:
        print(spec_summary(engine.spec.stats))
    if args.beam_width:
        beam_example(engine, tokenizer, args.beam_width, max_tokens=24)
    engine.shutdown()


if __name__ == "__main__":
    main()
