"""What the handlers share: the served names, model cards, API keys, and a request's preparation for the engine.

Preparing a request refuses what cannot be honoured (``sampling``), tokenizes or renders the
chat template in a one-thread pool off the event loop, reads the files of the LoRA adapter its
model names in a worker thread (so the engine thread only places the weights), cuts the prompt if
asked, checks the lengths against ``max_model_len`` and builds each prompt's SamplingParams
(BeamSearchParams with ``use_beam_search``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.core.lora_request import LoRARequest
from scheduler.core.params import SamplingParams
from scheduler.core.structured_params import StructuredOutputsParams
from scheduler.engine.beam_selection import BeamSearchParams
from scheduler.engine.llm_engine import LLMEngine
from scheduler.engine.request_checks import longest_sample
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.server.async_engine import AsyncEngine
from scheduler.entrypoints.server.config import LoRAModule, ServerConfig
from scheduler.entrypoints.server.errors import ModelNotFound, Unauthorized
from scheduler.entrypoints.server.protocol import ChatCompletionRequest, ChatRendering, SamplingFields
from scheduler.entrypoints.server.reasoning.output import PARSERS, ReasoningOutput, end_tag_ids, reasoning_output
from scheduler.entrypoints.server.sampling import (
    FieldError,
    beam_search_params,
    check_beam_search,
    check_request,
    sampling_params,
    structured_outputs,
)
from scheduler.entrypoints.server.serving import ResponseContext
from scheduler.entrypoints.server.tool_calling.choice import (
    ToolOutput,
    check_tools,
    keeps_special_tokens,
    tool_constraint,
    tool_output,
)
from scheduler.runner.lora_manager import ReadLoRA

log = logging.getLogger("paged_kv.server")
Prompts = list[tuple[list[int], str | None]]  # each prompt's token ids and its text (None: given as ids)
Readers = tuple[ToolOutput | None, ReasoningOutput | None]  # a chat's readers of tool calls and of reasoning


def max_model_len(engine: LLMEngine, cap: int | None) -> int:
    """The longest prompt + output one request can get: the model's context, ``cap``, the KV pool above its
    watermark for one sample, and without chunked prefill the step's token budget (the last two hold all but
    the last token, which is never fed back: ``longest_sample``)."""
    context = engine.model.config.max_position_embeddings
    if cap is not None and cap > context:
        raise InvalidArgumentError(describe("max_model_len", cap, f"at most the model's context, {context}"))
    pool, sched = engine.block_manager.config, engine.config.scheduler
    step = context if sched.enable_chunked_prefill else sched.max_num_batched_tokens
    pool_slots = (pool.num_blocks - pool.watermark_blocks) * pool.block_size
    return min(context, cap or context, longest_sample(pool_slots), longest_sample(step))


def authorize(keys: tuple[str, ...]) -> Callable:
    """A dependency that requires ``Authorization: Bearer <one of keys>`` (nothing when ``keys`` is empty)."""
    bearer = HTTPBearer(auto_error=False)
    expected = [k.encode() for k in keys]

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = credentials.credentials.encode() if credentials is not None else None
        if expected and not (given is not None and any(secrets.compare_digest(given, k) for k in expected)):
            raise Unauthorized("missing or invalid API key: expected 'Authorization: Bearer <key>'")

    return check


@dataclass
class Frontend:
    """The served model under its names, the engine thread, the options, and the tokenizer's own thread."""

    llm: LLM
    engine: AsyncEngine
    config: ServerConfig
    names: tuple[str, ...] = ()  # (): the model's own name
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.names = self.names or (self.llm.model_name,)
        # adapters served as models: --lora-modules, then those loaded at runtime (read on the event loop only)
        self.loras: dict[str, LoRAModule] = {m.name: m for m in self.config.lora_modules}
        self.max_model_len = max_model_len(self.llm.engine, self.config.max_model_len)
        # each reasoning parser's end tag as the model's tokens: where a constraint starts under it
        self.reasoning_ends = {name: end_tag_ids(self.llm.tokenizer, name) for name in PARSERS}
        # one thread: the tokenizer is never used by two requests at once (as in vLLM), the event loop never
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="paged-kv-tokenizer")

    def model_name(self, requested: str | None) -> str:
        """The name a request uses (the first served name when it gives none): the model's or an adapter's;
        ModelNotFound for any other."""
        if requested is None:
            return self.names[0]
        if requested not in self.names and requested not in self.loras:
            served = [*self.names, *self.loras]
            raise ModelNotFound(describe("model", requested, f"one of the served names {served}"))
        return requested

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a served name runs through (None: the base model)."""
        module = self.loras.get(name)
        return module.request if module is not None else None

    def card(self, name: str) -> dict:
        """The model card of ``name`` (vLLM's fields): an adapter's root is its path, its parent the base model."""
        module = self.loras.get(name)
        root = self.llm.model_name if module is None else module.path
        parent = None if module is None else module.base_model_name or self.names[0]
        return {"id": name, "object": "model", "created": self.created, "owned_by": "paged-kv",
                "root": root, "parent": parent, "max_model_len": self.max_model_len}  # fmt: skip

    def chat_prompt(self, body: ChatRendering) -> list[int]:
        """A conversation's prompt ids, rendered as the request asks; its own ``chat_template`` only when trusted;
        its tools left out for tool_choice "none" with --exclude-tools-when-tool-choice-none (a chat completion's:
        /tokenize has no tool choice and always renders them, as vLLM's)."""
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            expected = "no chat_template: this server runs without --trust-request-chat-template"
            raise FieldError("chat_template", describe("chat_template", "a template", expected))
        none = isinstance(body, ChatCompletionRequest) and body.chosen_tool == "none"
        tools = None if none and self.config.exclude_tools_when_tool_choice_none else body.tool_dicts()
        return self.llm.chat_prompt(body.message_dicts(), **body.chat_options(), tools=tools)

    def check_in_vocab(self, name: str, token_ids: Iterable[int]) -> None:
        """FieldError naming ``name`` for the largest of ``token_ids`` if it is out of the model's vocabulary."""
        vocab = self.llm.engine.model.config.vocab_size
        top = max(token_ids, default=0)
        if top >= vocab:
            raise FieldError(name, describe(name, f"token id {top}", f"token ids in [0, {vocab})"))

    def _compile(self, param: str, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar into the engine's cache; FieldError naming ``param``, the field that asked."""
        try:
            self.llm.engine.check_structured_outputs(spec)
        except InvalidArgumentError as e:
            raise FieldError(param, str(e)) from None

    def _constraints(self, body: SamplingFields) -> tuple[dict[str, object], str, Readers]:
        """The request's output constraint, the field that asks for it, and how its tool calls and reasoning are
        read (chat)."""
        constraints = structured_outputs(body)
        param = "response_format" if body.response_format else "structured_outputs"
        if not isinstance(body, ChatCompletionRequest):
            return constraints, param, (None, None)
        check_tools(body, self.config.enable_auto_tool_choice, constraints)
        reasoning = reasoning_output(body, self.config.reasoning_parser)
        parser = self.config.tool_call_parser
        if keeps_special_tokens(body, parser):  # as vLLM's parser asks: a tool tag may be a special token
            body.skip_special_tokens = False
        if reasoning is not None and reasoning.rules.keeps_special_tokens:  # its tags are special tokens
            body.skip_special_tokens = False
        tool = tool_constraint(body)
        if tool:  # a named or "required" call's schema (check_tools refused any other constraint with it)
            constraints, param = tool, "tools"
        if reasoning is not None and constraints:  # the grammar starts after the thinking, as vLLM's
            end = self.reasoning_ends[self.config.reasoning_parser]
            constraints = {"structured_outputs": reasoning.constrain(constraints["structured_outputs"], end)}
        return constraints, param, (tool_output(body, parser), reasoning)

    def _after_prompt(self, reasoning: ReasoningOutput, prompt: list[int],
                      constraints: dict[str, object]) -> dict[str, object]:  # fmt: skip
        """The reasoning read after ``prompt`` (as vLLM checks the prompt's ids for the end of thinking) and the
        constraints with their grammar starting where the output's thinking then ends."""
        text = self.llm.tokenizer.decode(prompt, skip_special_tokens=False)
        end = self.reasoning_ends[self.config.reasoning_parser]
        spec = reasoning.after_prompt(text, constraints.get("structured_outputs"), end)
        return {"structured_outputs": spec} if spec is not None else constraints

    async def prepare(self, body: SamplingFields, kind: str, encode: Callable[[], Prompts], num_prompts: int,
                      limit: tuple[str, int | None], logprobs: int | None
                      ) -> tuple[ResponseContext, Prompts, list[SamplingParams | BeamSearchParams]]:  # fmt: skip
        """A validated request's response context, prompts and parameters; refusals come before any tokenization.

        ``limit``: the output-length field and its value; ``logprobs``: top log-probabilities per token (None: none).
        """
        model = self.model_name(body.model)
        check_request(body, self.config.max_logprobs)
        constraints, param, (tools, reasoning) = self._constraints(body)
        if body.use_beam_search:
            check_beam_search(body, constraints)
        if num_prompts > self.engine.max_in_flight:  # never admitted: a 400, not a 503 forever
            expected = f"at most {self.engine.max_in_flight} prompts per request (--max-in-flight)"
            raise FieldError("prompt", describe("prompt", f"{num_prompts} prompts", expected))
        loop = asyncio.get_running_loop()
        if constraints:  # compile off the event loop (cached: the engine thread finds it); a bad one is a 400 here
            await loop.run_in_executor(self.tokenizer_pool, self._compile, param, constraints["structured_outputs"])
        encoded = await loop.run_in_executor(self.tokenizer_pool, encode)
        lora = await self.engine.read_lora(self.lora_request(model))  # a bad adapter: a 400 naming it
        prompts = [self._truncate(body, ids, text) for ids, text in encoded]
        if reasoning is not None:  # a chat's one prompt: where its thinking stands decides how its output reads
            constraints = await loop.run_in_executor(self.tokenizer_pool, self._after_prompt, reasoning,
                                                     prompts[0][0], constraints)  # fmt: skip
        self.check_in_vocab("prompt", (i for ids, _ in prompts for i in ids))
        params = [self._params(body, self._max_tokens(kind, ids, limit, body, lora), logprobs, constraints)
                  for ids, _ in prompts]  # fmt: skip
        ctx = ResponseContext(kind, model, body.n, self.llm.tokenizer, logprobs, request_id=body.request_id,
                              tokens_as_ids=body.return_tokens_as_token_ids, echo=getattr(body, "echo", False),
                              prompt_logprobs=body.prompt_logprobs,
                              echo_only=getattr(body, "echo", False) and body.max_tokens == 0,
                              continuous_usage=body.continuous_usage,
                              prompt_tokens=[len(ids) for ids, _ in prompts], tools=tools,
                              reasoning=reasoning, lora=lora)  # fmt: skip
        if self.config.log_requests:
            user = body.user or getattr(body, "safety_identifier", None)
            log.info("request %s: model %s, user %r, prompt tokens %s, %s", ctx.id, model, user,
                     [len(ids) for ids, _ in prompts], params[0])  # fmt: skip
        return ctx, prompts, params

    def _params(self, body: SamplingFields, max_tokens: int, logprobs: int | None,
                constraints: dict[str, object]) -> SamplingParams | BeamSearchParams:  # fmt: skip
        """One prompt's engine parameters: a beam search's with ``use_beam_search``, else the sampling ones."""
        engine = self.llm.engine
        vocab = engine.model.config.vocab_size
        if body.use_beam_search:
            eos = engine.scheduler.eos_token_ids
            return beam_search_params(body, max_tokens=max_tokens, logprobs=logprobs or 0, eos_token_ids=eos,
                                      vocab_size=vocab)  # fmt: skip
        return sampling_params(body, max_tokens=max_tokens, logprobs=logprobs or 0, vocab_size=vocab,
                               constraints=constraints)  # fmt: skip

    def _truncate(self, body: SamplingFields, ids: list[int], text: str | None) -> tuple[list[int], str | None]:
        """The prompt cut to ``truncate_prompt_tokens`` (-1: max_model_len) from ``truncation_side``."""
        keep = body.truncate_prompt_tokens
        keep = self.max_model_len if keep == -1 else keep
        if keep is None or len(ids) <= keep:
            return ids, text
        return (ids[-keep:] if body.truncation_side == "left" else ids[:keep]), None

    def _max_tokens(self, kind: str, ids: list[int], limit: tuple[str, int | None], body: SamplingFields,
                    lora: ReadLoRA | None) -> int:  # fmt: skip
        """The request's output limit within max_model_len and the KV pool for its samples; unset: all that fits."""
        name, requested = limit
        prompt_len, n = len(ids), body.num_samples
        prompt_field, longest = ("prompt" if kind == "completion" else "messages"), self.max_model_len
        pinned = self.engine.pinned_apart(ids, body.cache_salt, lora)
        room, pooled = longest - prompt_len, self.engine.max_new_tokens(prompt_len, n, pinned)
        if room < 1 or (requested is None and pooled < 1):
            expected = f"a prompt that leaves room to answer within max_model_len={longest} and the KV pool"
            raise FieldError(prompt_field, describe(prompt_field, f"{prompt_len} tokens", expected))
        if requested is None:
            return min(room, pooled)
        if requested > room:
            expected = f"at most {room}: the prompt has {prompt_len} tokens and max_model_len is {longest}"
            raise FieldError(name, describe(name, requested, expected))
        if requested > pooled:
            raise FieldError(name, describe(name, requested, f"at most {pooled}: {n} samples must fit in the KV pool"))
        return requested

