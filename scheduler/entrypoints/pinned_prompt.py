"""``paged-kv serve --pin-prompt FILE``: a system prompt kept on the device from start-up to shutdown.

What is pinned is exactly the token prefix every chat request with that system message starts
with: the common prefix of the chat template's renderings of the system message followed by
user messages that share nothing. That is the system turn and whatever the template writes
before the user's words, however the template renders (a plain-text prompt would miss the
template's own tokens). A model without a chat template pins the text as a plain prompt.

The prefix is the default rendering's (``add_generation_prompt`` only, the tokenizer's template, no
``chat_template_kwargs``, no BOS added). A request with other chat options may render another prefix
(its own ``chat_template``, template variables that change the system turn, ``add_special_tokens``):
it is served as any other request, only without the pinned blocks' hit.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.entrypoints.llm import LLM

log = logging.getLogger("paged_kv.server")
PROBES = ("a", "Z 9", "?!")  # user messages whose renderings share no first token


def read_prompt(path: str | os.PathLike) -> str:
    """The system prompt in a UTF-8 text file (its final newline is not part of it); InvalidArgumentError naming
    ``--pin-prompt`` if it cannot be read or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(describe("--pin-prompt", str(path), f"a readable UTF-8 text file ({e})")) from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise InvalidArgumentError(describe("--pin-prompt", str(path), "a file holding a system prompt (it is empty)"))
    return text


def system_prefix(llm: LLM, system: str) -> list[int]:
    """The token prefix every chat request whose first message is ``system`` (a system message) starts with."""
    if getattr(llm.tokenizer, "chat_template", None) is None:
        return llm.encode(system)[0]
    renders = [llm.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": p}])
               for p in PROBES]  # fmt: skip
    n = 0
    while all(len(r) > n for r in renders) and len({r[n] for r in renders}) == 1:
        n += 1
    return renders[0][:n]


def pin_system_prompt(llm: LLM, system: str) -> str:
    """Pin the prefix a chat request with system message ``system`` starts with, computing it now; the pin's id.

    Raises InvalidArgumentError naming ``--pin-prompt`` when the prefix is shorter than a KV block.
    """
    ids = system_prefix(llm, system)
    block = llm.engine.block_manager.block_size
    if len(ids) < block:
        expected = f"a system prompt of at least one KV block ({block} tokens, --block-size)"
        raise InvalidArgumentError(describe("--pin-prompt", f"{len(ids)} tokens", expected))
    pin_id = llm.pin_prefix(ids)
    held = llm.engine.pins.held.get(pin_id, 0)
    log.info("pinned the system prompt: %d of its %d prefix tokens held on the device (whole blocks)", held, len(ids))
    return pin_id
