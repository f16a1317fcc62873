"""Engine throughput on a GPU: a Llama-3.2-1B-shaped random model on nano-vllm's workload vs transformers.

Same prompts, same process, same device (``bench_engine.py --device cuda`` runs this):

- Workload (nano-vllm's ``bench.py``): 256 sequences of random token ids, input and output
  lengths uniform in [100, 1024] (Python ``random`` seeded 0, prompts drawn first, then the
  output lengths), ``ignore_eos``, temperature 0.6.
- Model: Llama-3.2-1B's shape (16 layers, hidden 2048, intermediate 8192, 32 query / 8 KV heads,
  head_dim 64, vocab 128256, tied embeddings, llama3 rope) with random weights, bf16.
- Sides: the paged-kv engine (continuous batching, ``max_num_seqs`` 256); transformers static
  padded batching (``generate`` on batches of ``--static-batch`` left-padded prompts up to the
  batch's longest limit; each request counts only its own tokens); transformers continuous
  batching (the manager behind ``model.generate_batch``, each request with its own
  ``max_new_tokens``).

Reported: generated tok/s of each side and the engine / baseline ratios; for the engine's decode
steps (every scheduled sequence decodes one token) the mean wall time of ``engine.step``, the GPU
span of ``engine.runner.run`` (CUDA events around it: it includes any GPU idle time inside the
call), and the floor of a step: weight bytes + KV bytes read, over the copy bandwidth measured in
the same run (bytes read + written per second by a large device-to-device copy). A probe at a
fixed decode batch adds the GPU-busy fraction: kernel time (union of the profiler's GPU
intervals) over unprofiled wall time per step.

    PYTHONPATH=. python benchmarks/bench_engine.py --device cuda
    PYTHONPATH=. python benchmarks/bench_engine.py --device cpu --workload nano-vllm --shape tiny --num-seqs 4 \\
        --max-input-len 120 --max-output-len 110   # a seconds-long check of this code on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from paged_kv.errors import UnknownSequenceError
from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.model.weights import from_hf_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machines have no network; nothing is downloaded

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
SHAPES = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
        max_position_embeddings=131072, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(  # the main job's model (SmolLM2-135M-Instruct's shape), without its package
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # for checking this script on a CPU in seconds
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
}  # fmt: skip
PROMPT_TOKEN_HIGH = 10000  # nano-vllm draws prompt ids in [0, 10000]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The GPU benchmark's options (a group of bench_engine.py's command line)."""
    g = p.add_argument_group("GPU benchmark (--device cuda, or --workload nano-vllm)")
    g.add_argument("--workload", choices=("chat", "nano-vllm"), default=None,
                   help="chat: the CPU benchmark (SmolLM2); nano-vllm: this one (default: nano-vllm on cuda)")
    g.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.2-1b", help="random model's shape")
    g.add_argument("--num-seqs", type=int, default=256, help="sequences in the workload (nano-vllm: 256)")
    g.add_argument("--min-len", type=int, default=100, help="shortest input and output length (nano-vllm: 100)")
    g.add_argument("--max-input-len", type=int, default=1024, help="longest prompt (nano-vllm: 1024)")
    g.add_argument("--max-output-len", type=int, default=1024, help="longest output (nano-vllm: 1024)")
    g.add_argument("--temperature", type=float, default=0.6, help="sampling temperature, 0 = greedy (nano-vllm: 0.6)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="engine: sequences per step (vLLM's default: 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="engine: new tokens per step (nano-vllm's default: 16384)")
    g.add_argument("--block-size", type=int, default=16, help="engine: tokens per KV block")
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="engine: KV pool in GiB (default: room for every sequence at full length)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="engine: size the pool as vLLM does (passed when CacheConfig has the field)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="engine: no CUDA graphs (passed when EngineConfig has the field)")
    g.add_argument("--static-batch", type=int, default=64, help="transformers static batching: prompts per batch")
    g.add_argument("--skip-static", action="store_true", help="do not run transformers static batching")
    g.add_argument("--skip-generate-batch", action="store_true", help="do not run transformers continuous batching")
    g.add_argument("--baseline-timeout", type=float, default=240.0,
                   help="seconds transformers continuous batching may run before it is stopped and reported as such")
    g.add_argument("--probe-batch", type=int, default=64, help="decode probe: sequences decoding together")
    g.add_argument("--probe-context", type=int, default=512, help="decode probe: prompt tokens of each sequence")
    g.add_argument("--probe-steps", type=int, default=16, help="decode probe: steps timed, then as many profiled")
    g.add_argument("--copy-gib", type=float, default=1.0, help="size of the copy that measures bandwidth")
    g.add_argument("--host-profile-top", type=int, default=25,
                   help="decode probe: host functions listed from a cProfile of as many more steps (0: none)")


# ---------------------------------------------------------------- workload and model


@dataclass(frozen=True)
class Workload:
    """Prompts (token id lists) and each one's number of output tokens."""

    prompts: list[list[int]]
    limits: list[int]

    @property
    def generated(self) -> int:
        """Tokens the workload asks for (ignore_eos: every request generates exactly its limit)."""
        return sum(self.limits)


def nano_vllm_workload(num_seqs: int, min_len: int, max_input: int, max_output: int, vocab: int, seed: int) -> Workload:
    """nano-vllm's bench workload: random prompts, then random output lengths, from one seeded generator."""
    rng = random.Random(seed)
    high = min(PROMPT_TOKEN_HIGH, vocab - 1)
    prompts = [[rng.randint(0, high) for _ in range(rng.randint(min_len, max_input))] for _ in range(num_seqs)]
    limits = [rng.randint(min_len, max_output) for _ in range(num_seqs)]
    return Workload(prompts, limits)


def random_llama(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers LlamaForCausalLM of the given shape with seeded random weights, on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS at all
    with torch.device(device):  # initialise on the device: fast for 1.2B parameters
        return LlamaForCausalLM(cfg).to(dtype).eval()


def has_field(cls: type, name: str) -> bool:
    """Whether the dataclass ``cls`` has the field ``name`` (options other engineers are adding)."""
    return any(f.name == name for f in dataclasses.fields(cls))


def kv_bytes_per_token(hf) -> int:
    """K and V bytes one token takes over all layers."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * hf.dtype.itemsize


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: every parameter once, less an untied input embedding."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and embed.weight.data_ptr() != head.weight.data_ptr():
        total -= embed.weight.numel() * embed.weight.element_size()  # only the step's rows are read
    return total


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Bytes read + written per second by a ``nbytes`` device-to-device copy (best of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_copy_seconds(src, dst) for _ in range(reps))
    del src, dst
    return 2 * nbytes / best


def _copy_seconds(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds of one ``dst.copy_(src)``: CUDA events on a GPU, the wall clock on the CPU."""
    if src.device.type != "cuda":
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def free_memory(device: torch.device) -> None:
    """Return freed tensors' memory to the device between the sides."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the engine


def build_engine(hf, args: argparse.Namespace, device: torch.device, work: Workload) -> tuple[LLMEngine, list[str]]:
    """The engine over ``hf``'s weights; also the notes on options this engine version does not have."""
    notes = []
    with torch.device(device):  # build the copy of the weights on the device
        model = from_hf_model(hf, dtype=hf.dtype)
    cache = dict(block_size=args.block_size, enable_prefix_caching=True)
    if args.gpu_memory_utilization is not None and has_field(CacheConfig, "gpu_memory_utilization"):
        cache["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        if args.gpu_memory_utilization is not None:
            notes.append("--gpu-memory-utilization ignored: CacheConfig has no such field yet")
        cache["kv_cache_bytes"] = kv_pool_bytes(args, work, kv_bytes_per_token(hf))
    extra = {}
    if has_field(EngineConfig, "enforce_eager"):
        extra["enforce_eager"] = args.enforce_eager
    elif args.enforce_eager:
        notes.append("--enforce-eager ignored: EngineConfig has no such field yet (the engine is eager)")
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    config = EngineConfig(cache=CacheConfig(**cache), scheduler=sched, device=str(device), **extra)
    return LLMEngine(model, config), notes


def kv_pool_bytes(args: argparse.Namespace, work: Workload, per_token: int) -> int:
    """The pool: --kv-cache-gib, else room for every sequence (or the probe's) at full length, +5% and the watermark."""
    if args.kv_cache_gib is not None:
        return int(args.kv_cache_gib * 2**30)
    blocks = sum(-(-(len(p) + n) // args.block_size) for p, n in zip(work.prompts, work.limits))
    probe = args.probe_batch * -(-(args.probe_context + probe_tokens(args)) // args.block_size)
    return int((max(blocks, probe) * 1.05 + 64) * args.block_size * per_token)


def probe_tokens(args: argparse.Namespace) -> int:
    """Output tokens each probe sequence may take: prefill's step, up to 64 waiting steps, then timed + profiled x 2."""
    return 3 * args.probe_steps + 128


@dataclass
class DecodeStep:
    """One engine step in which every scheduled sequence decoded a token."""

    wall_s: float  # engine.step, host wall clock
    gpu_s: float  # between CUDA events around engine.runner.run (0 on the CPU)
    batch: int
    context_tokens: int  # KV tokens the step's attention reads, over all sequences


class StepTimer:
    """Wraps an engine's ``step`` and its runner's ``run`` (instance attributes) to time its decode steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.cuda = engine, engine.device.type == "cuda"
        self._step, self._run_model = engine.step, engine.runner.run
        self._pending: list[tuple] = []  # (wall, start event, end event, batch, context) until synchronised
        self._this_step: tuple | None = None
        engine.step, engine.runner.run = self.step, self.run_model

    def run_model(self, out):
        """The runner's run between two CUDA events; remembers whether the step is all decodes."""
        decode = bool(out.scheduled) and all(s.num_tokens == 1 and s.start >= s.seq.prompt_len for s in out.scheduled)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else [None, None]
        if self.cuda:
            events[0].record()
        logits = self._run_model(out)
        if self.cuda:
            events[1].record()
        context = sum(s.start + 1 for s in out.scheduled)
        self._this_step = (decode, events, len(out.scheduled), context)
        return logits

    def step(self):
        """The engine's step, timed; a decode step is recorded."""
        self._this_step = None
        start = time.perf_counter()
        finished = self._step()
        wall = time.perf_counter() - start
        if self._this_step is not None and self._this_step[0]:
            _, events, batch, context = self._this_step
            self._pending.append((wall, *events, batch, context))
        return finished

    def decode_steps(self) -> list[DecodeStep]:
        """Every decode step recorded so far (synchronises the device once)."""
        synchronize(self.engine.device)
        return [DecodeStep(w, a.elapsed_time(b) / 1e3 if self.cuda else 0.0, n, c) for w, a, b, n, c in self._pending]

    def reset(self) -> None:
        """Forget the steps recorded so far."""
        self._pending.clear()

    def remove(self) -> None:
        """Give the engine its own methods back."""
        del self.engine.step, self.engine.runner.run


def run_engine(engine: LLMEngine, work: Workload, temperature: float) -> tuple[float, int]:
    """Wall seconds and generated tokens of the engine serving the whole workload (all queued at once)."""
    params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True) for n in work.limits]
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def warm_up_engine(engine: LLMEngine, vocab: int, temperature: float) -> None:
    """A few short requests: compiles the kernels before anything is timed."""
    prompts = [[(7 * i + j) % vocab for j in range(20 + 33 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)


def decode_probe(engine: LLMEngine, timer: StepTimer, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """``probe_batch`` sequences of ``probe_context`` tokens decoding together: wall and GPU-busy time per step."""
    rng, steps = random.Random(1), args.probe_steps
    high = min(PROMPT_TOKEN_HIGH, vocab - 1)
    params = SamplingParams(max_tokens=probe_tokens(args), temperature=args.temperature, ignore_eos=True)
    ids = [f"probe-{i}" for i in range(args.probe_batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randint(0, high) for _ in range(args.probe_context)], params)
    timer.reset()
    for _ in range(64):  # prefill, until a step decodes every sequence
        engine.step()
        if any(s.batch == args.probe_batch for s in timer.decode_steps()):
            break
    timer.reset()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps  # timed here: the timer may not see the engine's steps
    timed = timer.decode_steps() or [DecodeStep(wall, 0.0, 0, 0)]
    busy, launches = profiled_busy_seconds(engine, steps) if engine.device.type == "cuda" else (None, None)
    host = host_profile(engine, steps, args.host_profile_top)
    for request_id in ids:
        try:
            engine.abort(request_id)
        except UnknownSequenceError:  # finished already
            pass
    n = len(timed)
    return {
        "batch": sum(s.batch for s in timed) / n, "steps": steps, "wall_s": wall,
        "gpu_s": sum(s.gpu_s for s in timed) / n, "context": sum(s.context_tokens for s in timed) / n,
        "busy_s": busy, "busy_fraction": None if busy is None else busy / wall, "launches": launches, "host": host,
    }  # fmt: skip


def profiled_busy_seconds(engine: LLMEngine, steps: int) -> tuple[float | None, float | None]:
    """Mean GPU-busy seconds per step over ``steps`` profiled steps (the union of kernel and copy intervals), and
    GPU operations (kernels, copies, memsets) per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        gpu_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]  # kernels, copies, memsets
        spans = sorted((e.time_range.start, e.time_range.end) for e in gpu_events)
    except Exception as e:  # a profiler without CUPTI: report the rest
        print(f"(profiler failed: {e!r}; GPU-busy fraction not measured)")
        return None, None
    busy_us, end = 0.0, -math.inf
    for lo, hi in spans:  # union of intervals (streams may overlap)
        if hi > end:
            busy_us += hi - max(lo, end)
            end = hi
    return busy_us / 1e6 / steps, len(spans) / steps


def host_profile(engine: LLMEngine, steps: int, top: int) -> str:
    """cProfile of ``steps`` more engine steps: the ``top`` functions by own time, as printed lines."""
    if top <= 0:
        return ""

    def run() -> None:
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)

    return cprofile_top(run, top)


def cprofile_top(run: Callable[[], object], top: int) -> str:
    """cProfile of one ``run()``: the ``top`` functions by own time, as printed lines."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# ---------------------------------------------------------------- transformers


def sampling_options(temperature: float) -> dict:
    """transformers' generation options for our sampling: plain temperature sampling, or greedy."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False)


def run_static(hf, work: Workload, batch: int, temperature: float) -> tuple[float, int]:
    """Wall seconds and useful generated tokens of ``generate`` over static left-padded batches, in workload order."""
    device, useful = hf.device, 0
    start = time.perf_counter()
    for i in range(0, len(work.prompts), batch):
        prompts, limits = work.prompts[i : i + batch], work.limits[i : i + batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=mask, max_new_tokens=max(limits), pad_token_id=0, **sampling_options(temperature)
            )
        assert out.shape[1] == width + max(limits), "generation stopped early"  # no EOS: every batch runs to its end
        useful += sum(limits)  # each request's own tokens; the rest of the batch's rows are padding work
    synchronize(device)
    return time.perf_counter() - start, useful


class BaselineTimeout(RuntimeError):
    """A baseline stopped at its deadline; the message says how far it got."""


def run_generate_batch(hf, work: Workload, temperature: float, timeout: float = math.inf) -> tuple[float, int]:
    """Wall seconds and generated tokens of transformers' continuous batching (generate_batch's manager).

    ``generate_batch`` takes one ``max_new_tokens`` for all prompts; its manager takes one per
    request, as the workload needs. The clock runs from the first request to the last result:
    the manager's set-up and warm-up (graph capture) are left out, as for the engine. Past
    ``timeout`` seconds it raises :class:`BaselineTimeout` with the requests and tokens finished
    by then (none finished suggests a hang rather than a slow run).
    """
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max(work.limits), pad_token_id=0, **sampling_options(temperature))
    options = dict(generation_config=gen, block=True, timeout=5)
    if "workload_hints" in inspect.signature(hf.continuous_batching_context_manager).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        options["workload_hints"] = WorkloadHints(
            max_prompt_length=max(map(len, work.prompts)), max_generated_length=max(work.limits),
            num_requests=len(work.prompts),
        )  # fmt: skip
    results = {}
    with hf.continuous_batching_context_manager(**options) as manager:
        start = time.perf_counter()
        for i, (prompt, limit) in enumerate(zip(work.prompts, work.limits)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=limit, eos_token_id=-1)  # -1: no EOS
        while len(results) < len(work.prompts):
            if time.perf_counter() - start > timeout:
                done = sum(len(r.generated_tokens) for r in results.values())
                raise BaselineTimeout(
                    f"transformers continuous batching stopped at its {timeout:g} s deadline: {len(results)} of "
                    f"{len(work.prompts)} requests finished, {done} of {work.generated} tokens"
                )
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"transformers' continuous batching stopped after {len(results)} requests")
        elapsed = time.perf_counter() - start
    failed = [r.request_id for r in results.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"transformers' continuous batching failed requests {failed[:5]}")
    return elapsed, sum(len(r.generated_tokens) for r in results.values())


# ---------------------------------------------------------------- the run


def timed(label: str, fn: Callable[[], tuple[float, int]]) -> dict[str, float]:
    """Run one side; its seconds, tokens and tok/s (printed as soon as known)."""
    seconds, tokens = fn()
    print(f"  {label}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s", flush=True)
    return {"s": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def compare(args: argparse.Namespace) -> dict:
    """Every side on the same workload and device; the figures for ``report``."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = random_llama(args.shape, device, dtype)
    vocab = hf.config.vocab_size
    work = nano_vllm_workload(args.num_seqs, args.min_len, args.max_input_len, args.max_output_len, vocab, args.seed)
    f = {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."), "args": vars(args),
         "prompt_tokens": sum(map(len, work.prompts)), "requested": work.generated}  # fmt: skip
    f["copy_bw"] = copy_bandwidth(device, int(args.copy_gib * 2**30))
    print(f"{f['device']}: copy bandwidth {f['copy_bw'] / 1e9:,.0f} GB/s; workload {args.num_seqs} sequences, "
          f"{f['prompt_tokens']} prompt tokens, {work.generated} to generate", flush=True)  # fmt: skip

    start = time.perf_counter()
    engine, f["notes"] = build_engine(hf, args, device, work)
    f["engine_build_s"] = time.perf_counter() - start
    f["weight_bytes"], f["kv_token_bytes"] = weight_bytes_read(engine.model), kv_bytes_per_token(hf)
    f["engine_options"] = {k: getattr(engine.config, k) for k in ("enforce_eager",) if hasattr(engine.config, k)}
    warm_up_engine(engine, vocab, args.temperature)
    timer = StepTimer(engine)
    f["engine"] = timed("paged-kv engine", partial(run_engine, engine, work, args.temperature))
    f["decode"] = timer.decode_steps()
    f["probe"] = decode_probe(engine, timer, args, vocab) if args.probe_batch else None
    print("\n".join(decode_lines(f)), flush=True)  # before the baselines, which may run out of time
    if f["probe"] and f["probe"]["host"]:  # once, here: too long for the final report
        print(f"host profile of {args.probe_steps} more probe steps (cProfile, by own time):\n{f['probe']['host']}")
    timer.remove()
    del engine, timer
    free_memory(device)

    if not args.skip_static:
        f["static"] = timed(f"transformers static batches of {args.static_batch}",
                            lambda: run_static(hf, work, args.static_batch, args.temperature))  # fmt: skip
        free_memory(device)
    if not args.skip_generate_batch and not hasattr(hf, "continuous_batching_context_manager"):
        f["notes"].append("transformers continuous batching skipped: this transformers has no generate_batch manager")
    elif not args.skip_generate_batch:
        try:
            f["generate_batch"] = timed("transformers continuous batching",
                                        lambda: run_generate_batch(hf, work, args.temperature, args.baseline_timeout))
        except BaselineTimeout as stopped:
            f["notes"].append(str(stopped))
            print(f"  {stopped}", flush=True)
    return f


def device_name(device: torch.device) -> str:
    """The device in words, for the report."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    import platform

    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads), torch {torch.__version__}"


def floor_s(f: dict, context_tokens: float) -> float:
    """The least time a decode step can take: weights + KV read once, at the measured copy bandwidth."""
    return (f["weight_bytes"] + context_tokens * f["kv_token_bytes"]) / f["copy_bw"]


def report(f: dict) -> str:
    """The figures as printed lines, with the issue's targets."""
    a, engine = f["args"], f["engine"]
    lines = [
        f"machine: {f['device']}; model: {a['shape']} random weights, {f['dtype']}; "
        f"{f['weight_bytes'] / 2**30:.2f} GiB of weights read per decode step; engine built in "
        f"{f['engine_build_s']:.1f} s {f['engine_options'] or ''}",
        f"workload: {a['num_seqs']} sequences (seed {a['seed']}), input {a['min_len']}-{a['max_input_len']}, output "
        f"{a['min_len']}-{a['max_output_len']} tokens, ignore_eos, temperature {a['temperature']}; "
        f"{f['prompt_tokens']} prompt tokens, {f['requested']} to generate",
        f"engine: max_num_seqs {a['max_num_seqs']}, max_num_batched_tokens {a['max_num_batched_tokens']}, block size "
        f"{a['block_size']}",
        *[f"note: {n}" for n in f["notes"]],
        f"paged-kv engine: {engine['tok_s']:,.0f} generated tok/s ({engine['tokens']} tokens in {engine['s']:.1f} s)",
    ]  # fmt: skip
    for key, label in (("static", f"transformers static batches of {a['static_batch']}"),
                       ("generate_batch", "transformers continuous batching (generate_batch)")):  # fmt: skip
        if key in f:
            side = f[key]
            lines.append(f"{label}: {side['tok_s']:,.0f} tok/s ({side['tokens']} tokens in {side['s']:.1f} s); "
                         f"engine / it = {engine['tok_s'] / side['tok_s']:.2f}x")  # fmt: skip
    short = [k for k in ("engine", "static", "generate_batch") if k in f and f[k]["tokens"] != f["requested"]]
    lines += [f"WARNING: {k} generated {f[k]['tokens']} tokens, not the {f['requested']} asked for" for k in short]
    lines += decode_lines(f)
    lines += target_lines(f)
    return "\n".join(lines)


def decode_lines(f: dict) -> list[str]:
    """The engine's decode steps in the timed run, and the fixed-batch probe."""
    steps: list[DecodeStep] = f["decode"]
    if not steps:
        return ["decode steps: none recorded (engine.runner.run was not called through the engine's step)"]
    n = len(steps)
    wall, gpu = sum(s.wall_s for s in steps) / n, sum(s.gpu_s for s in steps) / n
    batch, context = sum(s.batch for s in steps) / n, sum(s.context_tokens for s in steps) / n
    floor = sum(floor_s(f, s.context_tokens) for s in steps) / n
    span = f"GPU span of runner.run {gpu * 1e3:.2f} ms ({gpu / wall:.0%} of wall), " if gpu else ""
    lines = [
        f"decode steps in the run: {n}, mean batch {batch:.0f}, mean KV read {context:,.0f} tokens; wall "
        f"{wall * 1e3:.2f} ms, {span}floor {floor * 1e3:.2f} ms (wall = {wall / floor:.1f}x floor)",
    ]  # fmt: skip
    p = f["probe"]
    if p and p["steps"]:
        span = f"GPU span {p['gpu_s'] * 1e3:.2f} ms, " if p["gpu_s"] else ""
        busy = "" if p["busy_s"] is None else f"GPU busy {p['busy_s'] * 1e3:.2f} ms = {p['busy_fraction']:.0%}, "
        launches = "" if p.get("launches") is None else f"{p['launches']:.0f} GPU operations per step, "
        lines.append(
            f"decode probe: batch {p['batch']:.0f}, context ~{p['context'] / max(p['batch'], 1):.0f} tokens, "
            f"{p['steps']} steps: wall {p['wall_s'] * 1e3:.2f} ms, {span}{busy}{launches}"
            f"floor {floor_s(f, p['context']) * 1e3:.2f} ms"
        )
    return lines


def target_lines(f: dict) -> list[str]:
    """The issue's targets that this run measures."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    tok_s = f["engine"]["tok_s"]
    lines = [f"target >= 12,000 generated tok/s: {verdict(tok_s >= 12000)} ({tok_s:,.0f}); nano-vllm publishes "
             "14,296 on an A100-40GB"]  # fmt: skip
    if "generate_batch" in f:
        ratio = tok_s / f["generate_batch"]["tok_s"]
        lines.append(f"target >= 10x generate_batch: {verdict(ratio >= 10)} ({ratio:.1f}x)")
    p = f["probe"]
    if p and p.get("busy_fraction") is not None and p["batch"] >= 32:
        lines.append(f"target GPU busy >= 85% of a decode step at batch >= 32: {verdict(p['busy_fraction'] >= 0.85)} "
                     f"({p['busy_fraction']:.0%} at batch {p['batch']:.0f})")  # fmt: skip
    return lines


def main(args: argparse.Namespace) -> None:
    """Run the GPU benchmark with bench_engine.py's parsed arguments."""
    print(report(compare(args)))
