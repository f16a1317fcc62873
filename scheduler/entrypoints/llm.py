"""The text-level offline API: ``LLM(model=...).generate(["a prompt"])`` returns text, as in vLLM.

An :class:`LLM` owns a tokenizer and an :class:`~scheduler.engine.llm_engine.LLMEngine`;
prompts are strings or token id lists, chats go through the tokenizer's chat
template, stop strings end samples, and every output carries its text
(incrementally detokenized) as well as its token ids.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping, Sequence

from tqdm.auto import tqdm

from paged_kv.config import PRIORITY_MAX, PRIORITY_MIN
from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_type, describe
from paged_kv.tokens import as_id_list
from scheduler.core.config import EngineConfig, LoRAConfig
from scheduler.core.lora_request import LoRARequest, lora_per_prompt
from scheduler.core.outputs import EmbeddingRequestOutput
from scheduler.core.params import SamplingParams, per_prompt
from scheduler.core.pooling_params import PoolingParams
from scheduler.core.speculative_config import SpeculativeConfig
from scheduler.engine.beam_search import BeamHypothesis, BeamSearch, BeamSearchOutput, BeamSearchParams
from scheduler.engine.llm_engine import LLMEngine
from scheduler.entrypoints.chat_rendering import ChatOptions, Messages, render_chat
from scheduler.entrypoints.detokenizer import IncrementalDetokenizer
from scheduler.entrypoints.output_processor import OutputProcessor, TextRequestOutput, with_bad_word_ids
from scheduler.entrypoints.pooler_checkpoint import checkpoint_pooler_config
from scheduler.model.loader import LoadedModel, load_model

Prompt = str | Sequence[int]
Params = SamplingParams | Sequence[SamplingParams] | None
LoRAs = LoRARequest | Sequence[LoRARequest | None] | None  # one adapter for every prompt, or one per prompt


class LLM:
    """A model, its tokenizer and a continuous-batching engine behind a text-in, text-out API."""

    def __init__(self, model: str | os.PathLike | LoadedModel | None = None, *,
                 engine_config: EngineConfig | None = None,
                 speculative_config: SpeculativeConfig | dict | None = None, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None) -> None:  # fmt: skip
        """Load ``model`` (a local folder, a .gguf file, None for SmolLM2, or an already loaded model).

        ``speculative_config`` (a SpeculativeConfig or its fields as a dict, as vLLM's ``LLM``) turns on n-gram
        speculative decoding; it replaces ``engine_config``'s. ``enable_lora`` (vLLM's, with ``max_loras``,
        ``max_lora_rank``, ``max_cpu_loras``: a :class:`LoRAConfig`) serves requests' ``lora_request`` adapters;
        it replaces ``engine_config``'s ``lora_config``.
        """
        check_type("model", model, (str, os.PathLike, LoadedModel, type(None)), "a path, a LoadedModel or None")
        check_type("engine_config", engine_config, (EngineConfig, type(None)), "an EngineConfig or None")
        if speculative_config is not None:
            spec = _speculative(speculative_config)
            engine_config = dataclasses.replace(engine_config or EngineConfig(), speculative_config=spec)
        lora = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)  # checked
        if check_bool("enable_lora", enable_lora):
            engine_config = dataclasses.replace(engine_config or EngineConfig(), lora_config=lora)
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
        engine_config = _with_checkpoint_pooling(engine_config, loaded)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.engine = LLMEngine.from_hf(loaded.hf_model, engine_config)
        self.engine.enable_structured_outputs(self.tokenizer)  # SamplingParams.structured_outputs
        self.processor = OutputProcessor(self.engine, self.tokenizer)
        self._ids = itertools.count()

    def encode(self, prompt: Prompt, *, add_special_tokens: bool = False) -> tuple[list[int], str | None]:
        """Token ids of a prompt (a string is tokenized, with the tokenizer's special tokens if asked; a token id
        list is taken as is) and its text."""
        check_bool("add_special_tokens", add_special_tokens)
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), prompt
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            return as_id_list("prompt", prompt, "token ids"), None
        raise InvalidArgumentError(describe("prompt", type(prompt).__name__, "a str or a list of token ids"))

    def chat_prompt(
        self, messages: Messages, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
        chat_template: str | None = None, chat_template_kwargs: Mapping[str, object] | None = None,
        add_special_tokens: bool = False, tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int]:  # fmt: skip
        """Token ids of a conversation rendered by the chat template (vLLM's options: ``chat_rendering.ChatOptions``;
        the defaults: ready for the answer, no BOS added to the rendered text), with ``tools`` given to the
        template as its function definitions."""
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template, add_special_tokens=add_special_tokens,
            chat_template_kwargs={} if chat_template_kwargs is None else chat_template_kwargs,
        )  # fmt: skip
        return render_chat(self.tokenizer, messages, options, tools)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None, *, use_tqdm: bool = False,
        priority: int | Sequence[int] = 0, lora_request: LoRAs = None,
    ) -> list[TextRequestOutput]:  # fmt: skip
        """Complete every prompt (strings or token id lists); outputs in prompt order, with ``.text``.

        ``lora_request`` (vLLM's): the LoRA adapter of every prompt, or one per prompt (None: the base model).
        ``priority`` (vLLM's, one for all prompts or one per prompt: lower is more important)
        orders the eviction of each request's cached blocks, and the scheduling under
        ``scheduling_policy="priority"``. A request that fails on its own
        (its sampling or detokenization raised) comes back with ``.error`` set and finish reason
        "error" on its unfinished samples; the others are not affected. A failure of the model
        step itself raises (every request was aborted).
        """
        check_bool("use_tqdm", use_tqdm)
        prompts = _prompt_list(prompts)
        priorities = _priorities(priority, len(prompts))
        encoded = [self.encode(p) for p in prompts]
        ids, texts = [ids for ids, _ in encoded], [text for _, text in encoded]
        return self._run(ids, texts, sampling_params, use_tqdm, priorities, lora_request)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *, use_tqdm: bool = False, priority: int | Sequence[int] = 0,
    ) -> list[EmbeddingRequestOutput]:  # fmt: skip
        """Embed every prompt (strings, tokenized without special tokens as ``generate`` does, or token id lists);
        outputs in prompt order, each vector in ``.outputs.embedding`` (vLLM's ``LLM.embed``).

        The engine pools as its ``EngineConfig.pooler_config`` says (not set: the checkpoint's declared pooling,
        else the last token, L2-normalized);
        ``pooling_params`` (one for all or one per prompt) may ask for ``dimensions`` (Matryoshka models) or
        ``normalize``. Every request is checked before any is queued.
        """
        check_bool("use_tqdm", use_tqdm)
        prompts = _prompt_list(prompts)
        priorities = _priorities(priority, len(prompts))
        params = per_prompt(pooling_params, len(prompts), PoolingParams, "pooling_params")
        encoded = [self.encode(p)[0] for p in prompts]
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, encoded, params):
            self.engine.check_pooling_request(rid, prompt, p)  # all or none
        for rid, prompt, p, priority in zip(ids, encoded, params, priorities):
            self.processor.add_embedding(rid, prompt, p, priority=priority)
        done: dict[str, EmbeddingRequestOutput] = {}
        with tqdm(total=len(ids), desc="embed", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                self.processor.step()
                for out in self.processor.take_embedded():
                    done[out.request_id] = out
                    bar.update(1)
        return [done[i] for i in ids]

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams | Sequence[BeamSearchParams] | None = None,
        *, use_tqdm: bool = False, lora_request: LoRAs = None,
    ) -> list[BeamSearchOutput]:  # fmt: skip
        """Beam-search every prompt (strings or token id lists), as vLLM's ``LLM.beam_search``; outputs in prompt
        order, each with up to ``width`` hypotheses best first, every one with its ``.text``.

        The search is :class:`~scheduler.engine.beam_search.BeamSearch`'s (transformers' semantics); a
        hypothesis's text is its output, decoded as ``generate`` decodes a sample: special tokens skipped
        (unless ``params.skip_special_tokens`` is False), the stop token (EOS or a stop id) that ended it adds
        no text (unless ``params.include_stop_str_in_output``, vLLM's).
        """
        check_bool("use_tqdm", use_tqdm)
        if isinstance(prompts, bytes) or not isinstance(prompts, (str, Sequence)) or not prompts:
            raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a prompt or a non-empty list"))
        if isinstance(prompts, str) or isinstance(prompts[0], int):
            prompts = [prompts]
        ids = [self.encode(p)[0] for p in prompts]
        each = per_prompt(params, len(ids), BeamSearchParams, "params")
        outs = BeamSearch(self.engine).generate(ids, each, use_tqdm=use_tqdm, lora_request=lora_request)
        texts = lambda out, p: [self._beam_text(out.prompt_token_ids, h, p) for h in out.hypotheses]  # noqa: E731
        return [dataclasses.replace(out, hypotheses=texts(out, p)) for out, p in zip(outs, each)]

    def _beam_text(self, prompt_token_ids: list[int], hyp: BeamHypothesis, params: BeamSearchParams) -> BeamHypothesis:
        """``hyp`` with its text: its tokens after the prompt, less the stop token that ended it unless kept."""
        cut = hyp.finish_reason == "stop" and not params.include_stop_str_in_output
        ids = hyp.token_ids[:-1] if cut else hyp.token_ids
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        return dataclasses.replace(hyp, text=detok.add(ids) + detok.flush())

    def chat(
        self, messages: Messages | Sequence[Messages], sampling_params: Params = None, *, use_tqdm: bool = False,
        add_generation_prompt: bool = True, continue_final_message: bool = False, chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None, add_special_tokens: bool = False,
        tools: Sequence[Mapping[str, object]] | None = None, lora_request: LoRAs = None,
    ) -> list[TextRequestOutput]:  # fmt: skip
        """Answer one conversation (a list of messages) or several, through ``lora_request`` as :meth:`generate`;
        outputs in order, with ``.text``.

        Each conversation is rendered as :meth:`chat_prompt` renders it with the same options and ``tools``
        (vLLM's ``LLM.chat``: the tools are only rendered, no call is parsed out of the text); every one is
        checked before any is queued.
        """
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs,
                   "add_special_tokens": add_special_tokens, "tools": tools}  # fmt: skip
        check_bool("use_tqdm", use_tqdm)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidArgumentError(describe("messages", messages, "a non-empty list of messages or of chats"))
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.chat_prompt(c, **options) for c in convs]
        return self._run(prompts, [None] * len(prompts), sampling_params, use_tqdm, lora_request=lora_request)

    def pin_prefix(self, prompt: Prompt, *, cache_salt: str | None = None) -> str:
        """Keep a prompt's full blocks (a system prompt; a str is tokenized) on the device, never evicted, until
        :meth:`unpin`; returns the pin's id.

        A prefix not cached yet is computed first; when no request is running that is done here,
        so the pin is held on return (else it takes hold in the step that computes it).
        """
        ids, _ = self.encode(prompt)
        idle = not self.engine.has_unfinished_requests()
        pin_id = self.engine.pin_prefix(ids, cache_salt=cache_salt)
        while idle and self.engine.pins.is_waiting(pin_id) and self.engine.has_unfinished_requests():
            self.engine.step()  # only the warm-up runs; its output is not returned
        if idle and pin_id not in self.engine.pins.held:
            raise RuntimeError(f"pin_prefix: the request computing the prefix failed; {pin_id} is not pinned")
        return pin_id

    def unpin(self, pin_id: str) -> None:
        """Release a pinned prefix: its blocks are cached and evictable again."""
        self.engine.unpin(pin_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (pinned prefixes stay): ``LLMEngine.reset_prefix_cache``; the blocks forgotten."""
        return self.engine.reset_prefix_cache()

    def _run(self, prompts: list[list[int]], texts: list[str | None], sampling_params, use_tqdm: bool,
             priorities: list[int] | None = None, lora_request: LoRAs = None):  # fmt: skip
        params = per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        params = [with_bad_word_ids(p, self.tokenizer) for p in params]
        priorities = priorities or [0] * len(prompts)
        loras = self.engine.stage_loras(lora_per_prompt(lora_request, len(prompts)))  # nothing loaded yet
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p, (key, _) in zip(ids, prompts, params, loras):
            self.engine.check_request(rid, prompt, p, lora=key)  # all or none
        for rid, prompt, p, text, priority, (_, read) in zip(ids, prompts, params, texts, priorities, loras):
            self.processor.add(rid, prompt, p, text, priority=priority, lora_request=read)
        done: dict[str, TextRequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for req, _, finished in self.processor.step():
                    if finished:
                        done[req.request_id] = req.result()
                        bar.update(1)
        return [done[i] for i in ids]


def _speculative(config: SpeculativeConfig | dict) -> SpeculativeConfig:
    """A SpeculativeConfig of its own or of a dict of its fields (a bad field raises naming it)."""
    if isinstance(config, SpeculativeConfig):
        return config
    check_type("speculative_config", config, dict, "a SpeculativeConfig, a dict of its fields or None")
    return SpeculativeConfig.from_dict(config)


def _with_checkpoint_pooling(config: EngineConfig | None, loaded: LoadedModel) -> EngineConfig | None:
    """``config`` with the pooling the checkpoint declares (sentence-transformers files, Matryoshka fields) when it
    sets none (``pooler_config`` None); an explicit PoolerConfig, the default one too, is kept."""
    if config is not None and config.pooler_config is not None:
        return config
    hf = loaded.hf_model
    declared = checkpoint_pooler_config(getattr(hf, "name_or_path", None) or None, getattr(hf, "config", None))
    if declared is None:
        return config
    return dataclasses.replace(config or EngineConfig(), pooler_config=declared)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a str or a token id list) or a non-empty list of them, as a list."""
    if isinstance(prompts, bytes) or not isinstance(prompts, (str, Sequence)) or not prompts:
        raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a prompt or a non-empty list"))
    if isinstance(prompts, str) or isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _priorities(priority: int | Sequence[int], n: int) -> list[int]:
    """Each of ``n`` prompts' priority: one int for all, or ``n`` of them (each any int64, as vLLM's)."""
    if not isinstance(priority, Sequence) or isinstance(priority, (str, bytes)):
        return [check_int("priority", priority, low=PRIORITY_MIN, high=PRIORITY_MAX)] * n
    if len(priority) != n:
        raise InvalidArgumentError(describe("priority", priority, f"an int or {n} of them (one per prompt)"))
    return [check_int(f"priority[{i}]", p, low=PRIORITY_MIN, high=PRIORITY_MAX) for i, p in enumerate(priority)]
