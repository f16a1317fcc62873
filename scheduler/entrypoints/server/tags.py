"""Tags in text that arrives piece by piece: what of a piece is ready, and what may begin a tag and waits."""

from __future__ import annotations


def ready_and_held(text: str, tag: str) -> tuple[str, str]:
    """``text`` split before its longest end that is a proper start of ``tag``: the ready part, and that end
    (held back: the next piece may complete the tag)."""
    held = next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)
    return text[: len(text) - held], text[len(text) - held :]
