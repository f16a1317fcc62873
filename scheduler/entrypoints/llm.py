"""The text-level offline API: ``LLM(model=...).generate(["a prompt"])`` returns text, as in vLLM.

An :class:`LLM` owns a tokenizer and an :class:`~scheduler.engine.llm_engine.LLMEngine`;
prompts are strings or token id lists, chats go through the tokenizer's chat
template, stop strings end samples, and every output carries its text
(incrementally detokenized) as well as its token ids.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence

from tqdm.auto import tqdm

from paged_kv.errors import InvalidArgumentError, check_bool, check_type, describe
from paged_kv.tokens import as_id_list
from scheduler.core.config import EngineConfig
from scheduler.core.params import SamplingParams, per_prompt
from scheduler.engine.llm_engine import LLMEngine
from scheduler.entrypoints.output_processor import OutputProcessor, TextRequestOutput, with_bad_word_ids
from scheduler.model.loader import LoadedModel, load_model

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, object]]
Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    """A model, its tokenizer and a continuous-batching engine behind a text-in, text-out API."""

    def __init__(self, model: str | os.PathLike | LoadedModel | None = None, *,
                 engine_config: EngineConfig | None = None) -> None:  # fmt: skip
        """Load ``model`` (a local folder, a .gguf file, None for SmolLM2, or an already loaded model)."""
        check_type("model", model, (str, os.PathLike, LoadedModel, type(None)), "a path, a LoadedModel or None")
        check_type("engine_config", engine_config, (EngineConfig, type(None)), "an EngineConfig or None")
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
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

    def chat_prompt(self, messages: Messages) -> list[int]:
        """Token ids of a conversation rendered by the tokenizer's chat template, ready for the answer."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidArgumentError(describe("messages", messages, "a non-empty list of {'role', 'content'}"))
        for i, m in enumerate(messages):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise InvalidArgumentError(describe(f"messages[{i}]", m, "a {'role': str, 'content': str} mapping"))
        try:
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        except Exception as e:  # template errors (jinja raise_exception, missing keys) mean bad messages
            expected = f"messages the chat template accepts ({e})"
            raise InvalidArgumentError(describe("messages", type(e).__name__, expected)) from None
        return list(ids["input_ids"] if isinstance(ids, Mapping) or hasattr(ids, "keys") else ids)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None, *, use_tqdm: bool = False
    ) -> list[TextRequestOutput]:  # fmt: skip
        """Complete every prompt (strings or token id lists); outputs in prompt order, with ``.text``.

        A request that fails on its own (its sampling or detokenization raised) comes back with
        ``.error`` set and finish reason "error" on its unfinished samples; the others are not
        affected. A failure of the model step itself raises (every request was aborted).
        """
        check_bool("use_tqdm", use_tqdm)
        if isinstance(prompts, bytes) or not isinstance(prompts, (str, Sequence)) or not prompts:
            raise InvalidArgumentError(describe("prompts", type(prompts).__name__, "a prompt or a non-empty list"))
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self.encode(p) for p in prompts]
        return self._run([ids for ids, _ in encoded], [text for _, text in encoded], sampling_params, use_tqdm)

    def chat(
        self, messages: Messages | Sequence[Messages], sampling_params: Params = None, *, use_tqdm: bool = False
    ) -> list[TextRequestOutput]:  # fmt: skip
        """Answer one conversation (a list of messages) or several; outputs in order, with ``.text``."""
        check_bool("use_tqdm", use_tqdm)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidArgumentError(describe("messages", messages, "a non-empty list of messages or of chats"))
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.chat_prompt(c) for c in convs]
        return self._run(prompts, [None] * len(prompts), sampling_params, use_tqdm)

    def _run(self, prompts: list[list[int]], texts: list[str | None], sampling_params, use_tqdm: bool):
        params = per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        params = [with_bad_word_ids(p, self.tokenizer) for p in params]
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.check_request(rid, prompt, p)  # all or none
        for rid, prompt, p, text in zip(ids, prompts, params, texts):
            self.processor.add(rid, prompt, p, text)
        done: dict[str, TextRequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for req, _, finished in self.processor.step():
                    if finished:
                        done[req.request_id] = req.result()
                        bar.update(1)
        return [done[i] for i in ids]

