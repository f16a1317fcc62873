"""The HTTP server's options, named as vLLM names its flags, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, check_type, describe
from scheduler.core.lora_request import LoRARequest
from scheduler.core.params import MAX_LOGPROBS

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a request body past this gets 413 before it is parsed
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3",
                     "deepseek_v31")  # readers of tool calls (``tool_calling.parsers``)
CONVERTS = ("none", "embed")  # what --convert adds to generation: nothing, or the embeddings endpoint
REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral")  # readers of a model's thinking (``reasoning.output.PARSERS``)


@dataclass(frozen=True, kw_only=True)
class LoRAModule:
    """An adapter served under its own model name (vLLM's --lora-modules entry); ``parent``: its /v1/models parent."""

    name: str
    path: str
    base_model_name: str | None = None  # None: the first served name

    def __post_init__(self) -> None:
        LoRARequest(name=self.name, path=self.path)  # checks name and path
        if self.base_model_name is not None and not (isinstance(self.base_model_name, str) and self.base_model_name):
            raise InvalidArgumentError(describe("lora_modules.base_model_name", self.base_model_name,
                                                "a non-empty str or None"))

    @property
    def request(self) -> LoRARequest:
        """The engine's request for this adapter."""
        return LoRARequest(name=self.name, path=self.path)

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``; typed errors."""
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(describe("lora_modules", text, f"valid JSON ({e})")) from None
            check_type("lora_modules", fields, dict, "a JSON object")
            unknown = set(fields) - {"name", "path", "base_model_name"}
            if unknown or not {"name", "path"} <= set(fields):
                raise InvalidArgumentError(describe("lora_modules", text, '{"name", "path"[, "base_model_name"]}'))
            return cls(**fields)
        name, sep, path = text.partition("=")
        if not sep:
            raise InvalidArgumentError(describe("lora_modules", text, "name=path or a JSON object"))
        return cls(name=name, path=path)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What ``build_app`` serves and how: model names, limits, log-probabilities, API keys, request logs."""

    served_model_names: tuple[str, ...] = ()  # names clients may use, the first in listings; (): the model's own
    max_in_flight: int = 256  # requests held at once (running + waiting); more get 503 with Retry-After
    max_model_len: int | None = None  # cap of prompt + max_tokens; None: what the model and the KV pool allow
    max_logprobs: int = 20  # most top log-probabilities a request may ask for (vLLM's default)
    api_keys: tuple[str, ...] = ()  # Bearer keys every /v1 route requires; (): no check
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    responses_store_size: int = 1024  # finished responses kept (LRU, in memory, per process); 0: none kept
    log_requests: bool = True  # log every request's id, sizes and sampling parameters
    enable_dev_endpoints: bool = False  # serve vLLM's dev-mode endpoints (POST /reset_prefix_cache); off: 404
    trust_request_chat_template: bool = False  # render with a request's own chat_template; off: a 400 naming it
    enable_auto_tool_choice: bool = False  # serve tool_choice "auto" (needs tool_call_parser); off: a 400 naming it
    tool_call_parser: str | None = None  # how "auto" reads tool calls out of the text: one of TOOL_CALL_PARSERS
    exclude_tools_when_tool_choice_none: bool = False  # a chat with tool_choice "none" renders without its tools
    reasoning_parser: str | None = None  # how chat answers' thinking is split out: one of REASONING_PARSERS
    lora_modules: tuple[LoRAModule, ...] = ()  # adapters served as models of their own (the engine needs LoRA on)
    # serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: 404
    allow_runtime_lora_updating: bool = False
    # vLLM's --convert: "embed" also serves POST /v1/embeddings from the same engine; "none": 404 there
    convert: str = "none"

    def __post_init__(self) -> None:
        if self.convert not in CONVERTS:
            raise InvalidArgumentError(describe("convert", self.convert, f"one of {CONVERTS}"))
        for field in ("served_model_names", "api_keys"):
            names = getattr(self, field)
            if not (isinstance(names, tuple) and all(isinstance(n, str) and n for n in names)):
                raise InvalidArgumentError(describe(field, names, "a tuple of non-empty str"))
        check_int("max_in_flight", self.max_in_flight, low=1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, low=1)
        check_int("max_logprobs", self.max_logprobs, low=0, high=MAX_LOGPROBS)
        check_int("max_request_bytes", self.max_request_bytes, low=1)
        check_int("responses_store_size", self.responses_store_size, low=0)
        check_bool("log_requests", self.log_requests)
        check_bool("enable_dev_endpoints", self.enable_dev_endpoints)
        check_bool("trust_request_chat_template", self.trust_request_chat_template)
        check_bool("enable_auto_tool_choice", self.enable_auto_tool_choice)
        check_bool("exclude_tools_when_tool_choice_none", self.exclude_tools_when_tool_choice_none)
        check_bool("allow_runtime_lora_updating", self.allow_runtime_lora_updating)
        if not (isinstance(self.lora_modules, tuple) and all(isinstance(m, LoRAModule) for m in self.lora_modules)):
            raise InvalidArgumentError(describe("lora_modules", self.lora_modules, "a tuple of LoRAModule"))
        names = [m.name for m in self.lora_modules]
        clash = next((n for n in names if names.count(n) > 1 or n in self.served_model_names), None)
        if clash is not None:
            raise InvalidArgumentError(describe("lora_modules", clash, "names apart from each other and the model's"))
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            expected = f"None or one of {TOOL_CALL_PARSERS}"
            raise InvalidArgumentError(describe("tool_call_parser", self.tool_call_parser, expected))
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            expected = f"None or one of {REASONING_PARSERS}"
            raise InvalidArgumentError(describe("reasoning_parser", self.reasoning_parser, expected))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            expected = "False without a tool_call_parser (--enable-auto-tool-choice requires --tool-call-parser)"
            raise InvalidArgumentError(describe("enable_auto_tool_choice", True, expected))
