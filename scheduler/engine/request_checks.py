"""Admission checks of a request: a valid prompt, and a size the engine can ever serve."""

from __future__ import annotations

from collections.abc import Sequence

from paged_kv.config import BlockManagerConfig
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, describe
from paged_kv.tokens import as_token_list
from scheduler.core.config import SchedulerConfig
from scheduler.core.params import SamplingParams
from scheduler.model.llama import ModelConfig


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


def check_request_fits(
    prompt_len: int, params: SamplingParams, model: ModelConfig, sched: SchedulerConfig, pool: BlockManagerConfig,
    *, pinned_blocks: int = 0,
) -> None:
    """Reject a request that could never finish: too long for the model, the step budget or the pool.

    The pool check is the worst case: every one of the ``n`` samples at full
    length, alone in the pool beside the ``pinned_blocks`` pinned prefixes hold
    that it does not share (never freed), sharing nothing else (so a request
    that passes can always run once the others are done or preempted).
    """
    total = prompt_len + params.max_tokens
    if total > model.max_position_embeddings:
        raise InvalidArgumentError(describe(
            "len(prompt_token_ids) + max_tokens", total, f"at most {model.max_position_embeddings} (model context)"
        ))  # fmt: skip
    if not sched.enable_chunked_prefill and total > sched.max_num_batched_tokens:
        raise InvalidArgumentError(describe(
            "len(prompt_token_ids) + max_tokens", total,
            f"at most max_num_batched_tokens={sched.max_num_batched_tokens} without chunked prefill",
        ))  # fmt: skip
    if params.n > sched.max_num_seqs:
        raise InvalidArgumentError(describe("n", params.n, f"at most max_num_seqs={sched.max_num_seqs}"))
    usable = pool.num_blocks - pool.watermark_blocks - pinned_blocks
    need = params.n * -(-total // pool.block_size)
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
