"""Admission checks of a request: a new id, a valid prompt and parameters, a size the engine can ever serve.

Each check raises a typed error (:mod:`paged_kv.errors`) and changes nothing, so a request refused
here leaves the engine as it was; one that passes can always run to the end (:func:`check_request_fits`).
:class:`RequestChecks` runs them for one engine: against its live requests, model, scheduler limits and pool.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING

from paged_kv.config import BlockManagerConfig
from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfRangeError,
    check_int,
    check_type,
    describe,
)
from paged_kv.tokens import as_token_list
from scheduler.core.config import SchedulerConfig
from scheduler.core.lora_request import LoRAKey, request_salt
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolerConfig, PoolingParams
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.model.llama import ModelConfig

if TYPE_CHECKING:
    from paged_kv.block_manager import BlockManager
    from scheduler.engine.structured_outputs import StructuredOutputs


def check_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt as a list of ids, each in ``[0, vocab_size)``; at least one token."""
    if isinstance(prompt_token_ids, int):
        raise InvalidArgumentError(describe("prompt_token_ids", prompt_token_ids, "a sequence of token ids"))
    tokens = as_token_list("prompt_token_ids", prompt_token_ids)
    if not tokens:
        raise InvalidArgumentError(describe("prompt_token_ids", tokens, "at least one token id"))
    if max(tokens) >= vocab_size:
        raise OutOfRangeError(describe("prompt_token_ids", max(tokens), f"token ids in [0, {vocab_size})"))
    return tokens


def capped_length(prompt_len: int, max_tokens: int, context: int) -> int:
    """The most tokens a sample of a prompt reaches: ``max_tokens`` outputs, stopped once the sample holds
    ``context`` tokens (at least one output: a prompt of exactly ``context`` tokens gets one), as vLLM's
    scheduler stops a request at max_model_len."""
    return prompt_len + min(max_tokens, max(context - prompt_len, 1))


def kv_length(total: int) -> int:
    """KV slots a sample of ``total`` tokens ever holds: all but its last, which ends it when sampled and is never
    fed back (the scheduler appends a token's slot only in the step that computes it)."""
    return total - 1


def longest_sample(kv_slots: int) -> int:
    """The most tokens a sample reaches holding at most ``kv_slots`` KV slots: the inverse of :func:`kv_length`."""
    return kv_slots + 1


def check_within_context(prompt_len: int, max_tokens: int, model: ModelConfig) -> None:
    """Refuse ``prompt_len + max_tokens`` past the model context: for a search that runs every sequence to
    ``max_tokens`` rather than stopping at the context."""
    total, context = prompt_len + max_tokens, model.max_position_embeddings
    if total > context:
        expected = f"at most {context} (model context)"
        raise InvalidArgumentError(describe("len(prompt_token_ids) + max_tokens", total, expected))


def check_pooling_fits(prompt_len: int, model: ModelConfig, sched: SchedulerConfig, pool: BlockManagerConfig,
                       *, pinned_blocks: int = 0) -> None:  # fmt: skip
    """Reject an embedding request that could never finish: its prompt (every token computed, nothing generated)
    longer than the model context, the step budget without chunked prefill, or the pool beside the pinned blocks."""
    context = model.max_position_embeddings
    if prompt_len > context:
        raise InvalidArgumentError(describe("len(prompt_token_ids)", prompt_len, f"at most {context} (model context)"))
    if not sched.enable_chunked_prefill and prompt_len > sched.max_num_batched_tokens:
        raise InvalidArgumentError(describe("len(prompt_token_ids)", prompt_len,
                                            f"at most max_num_batched_tokens={sched.max_num_batched_tokens} "
                                            "without chunked prefill"))  # fmt: skip
    usable = pool.num_blocks - pool.watermark_blocks - pinned_blocks
    if -(-prompt_len // pool.block_size) > usable:
        raise InvalidArgumentError(describe("len(prompt_token_ids)", prompt_len,
                                            f"at most {usable * pool.block_size} tokens (the KV pool)"))


def check_request_fits(
    prompt_len: int, params: SamplingParams, model: ModelConfig, sched: SchedulerConfig, pool: BlockManagerConfig,
    *, pinned_blocks: int = 0,
) -> None:
    """Reject a request that could never finish: a prompt longer than the model context, or a sample too long
    for the step budget or the pool.

    A sample is as long as ``max_tokens`` makes it within the model context (:func:`capped_length`: the
    engine stops it there with "length", as vLLM does); it computes, and holds KV for, all but its last token
    (:func:`kv_length`), in one step when recomputed after a preemption without chunked prefill. The pool
    check is the worst case: every one of the ``n`` samples at that length, alone in the pool beside the
    ``pinned_blocks`` pinned prefixes hold that it does not share (never freed), sharing nothing else (so a
    request that passes can always run once the others are done or preempted).
    """
    context = model.max_position_embeddings
    if prompt_len > context:
        raise InvalidArgumentError(describe("len(prompt_token_ids)", prompt_len, f"at most {context} (model context)"))
    total = capped_length(prompt_len, params.max_tokens, context)
    computed = kv_length(total)  # >= prompt_len: a sample has at least one output
    if not sched.enable_chunked_prefill and computed > sched.max_num_batched_tokens:
        raise InvalidArgumentError(describe(
            "len(prompt_token_ids) + max_tokens", total,
            f"at most max_num_batched_tokens + 1 = {sched.max_num_batched_tokens + 1} without chunked prefill"
            " (all but the last token are computed)",
        ))  # fmt: skip
    if params.n > sched.max_num_seqs:
        raise InvalidArgumentError(describe("n", params.n, f"at most max_num_seqs={sched.max_num_seqs}"))
    usable = pool.num_blocks - pool.watermark_blocks - pinned_blocks
    need = params.n * -(-computed // pool.block_size)
    if need > usable:
        pins = f" ({pinned_blocks} held by pinned prefixes)" if pinned_blocks else ""
        raise InvalidArgumentError(describe(
            "len(prompt_token_ids) + max_tokens", total,
            f"a request whose {params.n} sample(s) fit in the pool: needs {need} blocks, {usable} usable{pins}",
        ))  # fmt: skip


def check_sampling_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids of the logits controls inside the vocabulary; ``bad_words`` only with their token ids."""
    expected = f"token ids in [0, {vocab_size})"
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise OutOfRangeError(describe("logit_bias", max(params.logit_bias), f"keys that are {expected}"))
    if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab_size:
        raise OutOfRangeError(describe("allowed_token_ids", max(params.allowed_token_ids), expected))
    words = params.bad_words_token_ids
    if words and max(max(w) for w in words) >= vocab_size:
        raise OutOfRangeError(describe("bad_words_token_ids", max(max(w) for w in words), expected))
    if params.bad_words and not words:
        raise InvalidArgumentError(describe("bad_words", params.bad_words, (
            "words with their bad_words_token_ids: a text layer with a tokenizer (LLM, the server) fills them in"
        )))  # fmt: skip


def check_request_id(request_id: str, live: Container[str]) -> None:
    """A non-empty str not already the id of a live request."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgumentError(describe("request_id", request_id, "a non-empty str"))
    if request_id in live:
        raise DuplicateSequenceError(describe("request_id", request_id, "an id not already in use"))


def check_structured_outputs(spec: StructuredOutputsParams, structured: StructuredOutputs | None) -> None:
    """Compile (and cache) a request's grammar now: an invalid one, a ``start_after`` id past the model's rows, or
    no tokenizer, raises before queueing."""
    check_type("structured_outputs", spec, StructuredOutputsParams, "a StructuredOutputsParams")
    if structured is None:
        expected = "None on an engine without a tokenizer (call enable_structured_outputs(tokenizer) first)"
        raise InvalidArgumentError(describe("structured_outputs", spec.kind, expected))
    if spec.start_after is not None and max(spec.start_after) >= structured.vocab_size:
        expected = f"token ids in [0, {structured.vocab_size})"
        raise OutOfRangeError(describe("structured_outputs.start_after", max(spec.start_after), expected))
    structured.grammar(spec)


def check_sample_indices(indices: Iterable[int], num_samples: int) -> set[int]:
    """Sample indices as a set: a sequence (or set) of ints in ``[0, num_samples)``; OutOfRangeError past either end."""
    items = list(indices) if isinstance(indices, (set, frozenset)) else indices
    items = items.tolist() if hasattr(items, "tolist") else items  # numpy arrays, torch tensors
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidArgumentError(describe("indices", type(indices).__name__, "a sequence of sample indices"))
    return {check_int(f"indices[{i}]", v, low=0, high=num_samples - 1) for i, v in enumerate(items)}


class RequestChecks:
    """One engine's admission checks: a request against its live ids, its model, its scheduler limits and its pool
    beside the pinned prefixes."""

    def __init__(self, live: Container[str], model: ModelConfig, sched: SchedulerConfig, block_manager: BlockManager,
                 pooler: PoolerConfig) -> None:  # fmt: skip
        self.live = live  # the scheduler's unfinished requests, by id
        self.model, self.sched, self.block_manager, self.pooler = model, sched, block_manager, pooler

    def sampled(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None,
        lora: LoRAKey | None, structured: StructuredOutputs | None,
    ) -> tuple[list[int], SamplingParams]:  # fmt: skip
        """A generation request's prompt as a list and its parameters (``lora``: its adapter's key, ``structured``:
        the engine's grammars, None without a tokenizer)."""
        check_type("lora", lora, (LoRAKey, type(None)), "a LoRAKey (from load_lora) or None")
        params = sampling_params if sampling_params is not None else SamplingParams()
        check_request_id(request_id, self.live)
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(describe("sampling_params", type(params).__name__, "a SamplingParams"))
        prompt = check_prompt(prompt_token_ids, self.model.vocab_size)
        check_sampling_ids(params, self.model.vocab_size)
        salt = request_salt(params.cache_salt, lora)
        check_request_fits(len(prompt), params, self.model, self.sched, self.block_manager.config,
                           pinned_blocks=self._pinned_apart(prompt, salt))  # fmt: skip
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs, structured)
        return prompt, params

    def pooling(
        self, request_id: str, prompt_token_ids: Sequence[int], pooling_params: PoolingParams | None
    ) -> tuple[list[int], PoolingParams]:  # fmt: skip
        """An embedding request's prompt as a list and its parameters resolved by the engine's pooler config."""
        check_request_id(request_id, self.live)
        params = self.pooler.resolve(pooling_params, self.model.hidden_size)
        prompt = check_prompt(prompt_token_ids, self.model.vocab_size)
        check_pooling_fits(len(prompt), self.model, self.sched, self.block_manager.config,
                           pinned_blocks=self._pinned_apart(prompt, None))  # fmt: skip
        return prompt, params

    def _pinned_apart(self, prompt: list[int], cache_salt: str | None) -> int:
        """The pinned prefixes' blocks ``prompt`` does not share (held, never freed, beside its own)."""
        bm = self.block_manager
        return bm.num_pinned_blocks_apart(prompt, cache_salt=cache_salt) if bm.pinned else 0
