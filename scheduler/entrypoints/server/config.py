"""The HTTP server's options, named as vLLM names its flags, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from paged_kv.errors import InvalidArgumentError, check_bool, check_int, describe
from scheduler.core.params import MAX_LOGPROBS

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a request body past this gets 413 before it is parsed
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "deepseek_v3",
                     "deepseek_v31")  # readers of tool calls (``tool_calling.parsers``)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral")  # readers of a model's thinking (``reasoning.output.PARSERS``)


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

    def __post_init__(self) -> None:
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
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            expected = f"None or one of {TOOL_CALL_PARSERS}"
            raise InvalidArgumentError(describe("tool_call_parser", self.tool_call_parser, expected))
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            expected = f"None or one of {REASONING_PARSERS}"
            raise InvalidArgumentError(describe("reasoning_parser", self.reasoning_parser, expected))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            expected = "False without a tool_call_parser (--enable-auto-tool-choice requires --tool-call-parser)"
            raise InvalidArgumentError(describe("enable_auto_tool_choice", True, expected))
