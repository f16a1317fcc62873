"""A conversation rendered by a chat template into prompt token ids, with vLLM's rendering options.

As vLLM renders a chat: transformers' ``apply_chat_template`` writes the conversation as text
(``add_generation_prompt``, ``continue_final_message``, ``chat_template`` and the template's own
variables, ``chat_template_kwargs``), then the tokenizer encodes that text, adding its special
tokens (BOS) only with ``add_special_tokens``. The defaults give exactly the ids of
``apply_chat_template(messages, add_generation_prompt=True)``. ``tools`` (function definitions,
OpenAI's ``{"type": "function", "function": {...}}`` objects) go to the template as its ``tools``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from paged_kv.errors import InvalidArgumentError, check_bool, describe

Messages = Sequence[Mapping[str, object]]
# apply_chat_template's own arguments and the variables it sets: never a template variable of the request's
RESERVED_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "tokenize", "return_dict", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
})  # fmt: skip
MAX_ERROR_CHARS = 300  # of a template's error message, quoted in the refusal


@dataclass(frozen=True, kw_only=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's chat options); InvalidArgumentError naming a bad one."""

    add_generation_prompt: bool = True  # the template's header that starts the assistant's answer
    continue_final_message: bool = False  # the final message (usually the assistant's) left open, to be continued
    chat_template: str | None = None  # a Jinja template used instead of the tokenizer's
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)  # extra template variables
    add_special_tokens: bool = False  # the tokenizer's special tokens (BOS) around the rendered text

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
            check_bool(name, getattr(self, name))
        if self.add_generation_prompt and self.continue_final_message:
            expected = "False while add_generation_prompt is True (cannot set both: set add_generation_prompt False)"
            raise InvalidArgumentError(describe("continue_final_message", True, expected))
        if self.chat_template is not None and not (isinstance(self.chat_template, str) and self.chat_template):
            raise InvalidArgumentError(describe("chat_template", self.chat_template, "a non-empty Jinja str or None"))
        _check_kwargs(self.chat_template_kwargs)


def _check_kwargs(kwargs: object) -> None:
    """InvalidArgumentError naming ``chat_template_kwargs`` unless a str-keyed mapping free of reserved keys."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgumentError(describe("chat_template_kwargs", kwargs, "a mapping of str keys to values"))
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        expected = f"template variables other than the rendering's own arguments {sorted(RESERVED_KWARGS)}"
        raise InvalidArgumentError(describe("chat_template_kwargs", reserved[0], expected))


def check_messages(messages: object) -> list[Mapping[str, object]]:
    """``messages`` as a list of ``{'role': str, 'content': str}`` mappings, else InvalidArgumentError naming
    ``messages`` (any role may come last: ``continue_final_message`` leaves it open, as vLLM and transformers)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidArgumentError(describe("messages", messages, "a non-empty list of {'role', 'content'}"))
    for i, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidArgumentError(describe(f"messages[{i}]", m, "a {'role': str, 'content': str} mapping"))
    return list(messages)


def check_tools(tools: object) -> list[Mapping[str, object]] | None:
    """``tools`` as a list of mappings (None: no tools), else InvalidArgumentError naming ``tools``."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or not tools:
        raise InvalidArgumentError(describe("tools", tools, "None or a non-empty list of tool definitions"))
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidArgumentError(describe(f"tools[{i}]", tool, "a tool definition mapping"))
    return list(tools)


def render_chat(tokenizer, messages: object, options: ChatOptions, tools: object = None) -> list[int]:
    """The token ids of ``messages`` (and ``tools``) rendered by the chat template as ``options`` say; a template
    that fails is an InvalidArgumentError naming ``chat_template`` (the request's) or ``messages`` (the
    tokenizer's)."""
    conversation, tools = check_messages(messages), check_tools(tools)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=options.chat_template, tokenize=False,
            add_generation_prompt=options.add_generation_prompt, continue_final_message=options.continue_final_message,
            **options.chat_template_kwargs,
        )  # fmt: skip
    except Exception as e:  # jinja errors (syntax, raise_exception, missing keys), a final message not found
        name = "messages" if options.chat_template is None else "chat_template"
        expected = f"{name} the chat template renders ({str(e)[:MAX_ERROR_CHARS]})"
        raise InvalidArgumentError(describe(name, type(e).__name__, expected)) from None
    return list(tokenizer(text, add_special_tokens=options.add_special_tokens)["input_ids"])
