"""Random engine workloads for the property tests: configs, requests, operations, and the lone results to
compare with (each distinct request run once alone on a fresh engine with a big pool, then remembered)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from sched_helpers import VOCAB, make_engine

from scheduler import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler.engine.beam_search import BeamSearch, BeamSearchParams

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head dim 16, float32
CONTEXTS = (512, 24)  # model contexts: the tiny Llama's, and a short one that caps samples ("length")
PREFIXES = ([7, 1, 9, 3, 5, 11, 2, 8, 4, 6, 10, 12], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211])


@dataclass(frozen=True)
class Config:
    """One engine's knobs and its model's context."""

    context: int
    block_size: int
    num_blocks: int
    watermark: float
    budget: int  # max_num_batched_tokens
    max_seqs: int
    chunked: bool
    prefix: bool
    mode: str  # preemption mode
    num_cpu_blocks: int
    policy: str
    host_blocks: int  # host tier size in blocks (0: none)
    host_store: str  # what feeds the host tier: "evict" or "write"

    def engine(self, hf_model):
        """A fresh engine of this config over ``hf_model`` (a model of context ``context``)."""
        cache = CacheConfig(
            block_size=self.block_size, num_gpu_blocks=self.num_blocks, num_cpu_blocks=self.num_cpu_blocks,
            watermark=self.watermark, enable_prefix_caching=self.prefix,
            kv_offloading_bytes=self.host_blocks * self.block_size * TOKEN_BYTES, host_store=self.host_store,
        )  # fmt: skip
        sched = SchedulerConfig(
            max_num_batched_tokens=self.budget, max_num_seqs=self.max_seqs, enable_chunked_prefill=self.chunked,
            preemption_mode=self.mode, scheduling_policy=self.policy,
        )  # fmt: skip
        return LLMEngine.from_hf(hf_model, EngineConfig(cache=cache, scheduler=sched, device="cpu"))


@dataclass(frozen=True)
class Request:
    """A sampled request: ``stop_pick`` picks its stop id among its lone tokens (None: no stop id)."""

    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    seed: int | None  # None: greedy
    stop_pick: int | None
    salt: str | None
    priority: int


@dataclass(frozen=True)
class Beam:
    """A beam search."""

    prompt: tuple[int, ...]
    width: int
    max_tokens: int
    salt: str | None
    priority: int


@st.composite
def configs(draw) -> Config:
    """Small pools (preemption), small budgets, every policy and preemption mode, a host tier sometimes."""
    max_seqs = draw(st.integers(2, 8))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    prefix = draw(st.booleans())
    block_size = draw(st.sampled_from([2, 4, 4, 8]))
    return Config(
        context=draw(st.sampled_from(CONTEXTS)), block_size=block_size,
        num_blocks=draw(st.integers(24, 64)) // block_size, watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.25])),
        budget=draw(st.integers(max(max_seqs, 6), 48)), max_seqs=max_seqs,
        chunked=draw(st.booleans()), prefix=prefix, mode=mode,
        num_cpu_blocks=draw(st.integers(1, 40)) if mode == "swap" else 0,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        host_blocks=draw(st.sampled_from([0, 0, 8, 32])) if prefix else 0,
        host_store=draw(st.sampled_from(["evict", "write"])),
    )  # fmt: skip


@st.composite
def prompts(draw) -> tuple[int, ...]:
    """A prompt, often starting with part of a shared prefix."""
    head = draw(st.sampled_from([(), *PREFIXES]))
    head = head[: draw(st.integers(0, len(head)))]
    tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if head else 1, max_size=16))
    return (*head, *tail)


priorities = st.integers(-1, 1)
salts = st.sampled_from([None, None, "s"])


@st.composite
def requests(draw) -> Request:
    """Greedy, seeded or n > 1 requests of up to 10 tokens, a stop id sometimes."""
    return Request(
        prompt=draw(prompts()), max_tokens=draw(st.integers(1, 24)), n=draw(st.sampled_from([1, 1, 2, 4])),
        seed=draw(st.sampled_from([None, 0, 1])), stop_pick=draw(st.sampled_from([None, None, 0, 2, 5])),
        salt=draw(salts), priority=draw(priorities),
    )  # fmt: skip


@st.composite
def beams(draw) -> Beam:
    """Beam searches of widths 1 to 3 and up to 6 tokens."""
    return Beam(prompt=draw(prompts()), width=draw(st.integers(1, 4)), max_tokens=draw(st.integers(1, 8)),
                salt=draw(salts), priority=draw(priorities))  # fmt: skip


@st.composite
def pin_prompts(draw) -> tuple[tuple[int, ...], str | None]:
    """A prompt to pin and its salt: part of a shared prefix (the requests' prompts often start with one), a short
    tail sometimes; shorter than a block sometimes (refused)."""
    head = draw(st.sampled_from(PREFIXES))
    tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
    return (*head[: draw(st.integers(1, len(head)))], *tail), draw(salts)


operations = st.one_of(
    st.tuples(st.just("add"), st.lists(st.one_of(requests(), requests(), beams()), min_size=1, max_size=6)),
    st.tuples(st.just("pin"), pin_prompts()),
    st.tuples(st.just("unpin"), st.integers(0, 1 << 10)),  # an index into the pins not released
    st.tuples(st.just("abort"), st.integers(0, 1 << 10)),  # an index into the live ids, or the ended ones if odd
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("reset"), st.none()),  # reset_prefix_cache
)


def sampling(req: Request, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The engine's parameters of a sampled request (its stop id resolved by the caller)."""
    temperature = 0.0 if req.seed is None else 1.0
    return SamplingParams(max_tokens=req.max_tokens, n=req.n, temperature=temperature, seed=req.seed,
                          stop_token_ids=stop_ids, cache_salt=req.salt)  # fmt: skip


def beam_params(req: Beam) -> BeamSearchParams:
    """The engine's parameters of a beam search."""
    return BeamSearchParams(width=req.width, max_tokens=req.max_tokens, cache_salt=req.salt)


class LoneResults:
    """Each distinct request's result run alone on a fresh engine with a big pool (same model and block size as
    the engine it is compared with), computed once."""

    def __init__(self, models: dict[int, object]) -> None:
        self.models = models  # context -> transformers model
        self._samples: dict[tuple, list[tuple[list[int], str]]] = {}
        self._beams: dict[tuple, list[tuple[list[int], float]]] = {}

    def engine(self, cfg: Config):
        """A fresh engine with a big pool, of ``cfg``'s model and block size."""
        return make_engine(self.models[cfg.context], block_size=cfg.block_size, num_blocks=1024 // cfg.block_size)

    def params(self, cfg: Config, req: Request) -> SamplingParams:
        """A request's parameters, its stop id (if any) picked among the tokens of its first lone sample."""
        if req.stop_pick is None:
            return sampling(req)
        tokens = self.samples(cfg, req.prompt, sampling(req))[0][0]
        return sampling(req, (tokens[req.stop_pick % len(tokens)],))

    def samples(self, cfg: Config, prompt: tuple[int, ...], params: SamplingParams) -> list[tuple[list[int], str]]:
        """(token ids, finish reason) of each sample, in index order."""
        key = (cfg.context, cfg.block_size, prompt, params)
        if key not in self._samples:
            out = self.engine(cfg).generate([list(prompt)], params, use_tqdm=False)[0]
            self._samples[key] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        return self._samples[key]

    def beams(self, cfg: Config, req: Beam) -> list[tuple[list[int], float]]:
        """(token ids, cumulative logprob) of each hypothesis, best first."""
        key = (cfg.context, cfg.block_size, req.prompt, req.width, req.max_tokens)
        if key not in self._beams:
            out = BeamSearch(self.engine(cfg)).generate([list(req.prompt)], beam_params(req))
            self._beams[key] = [(h.token_ids, h.cumulative_logprob) for h in out[0].hypotheses]
        return self._beams[key]
