"""ready_and_held: the end of a piece that may begin a tag waits for the next piece."""

from __future__ import annotations

from scheduler.entrypoints.server.tags import ready_and_held


def test_the_longest_proper_start_of_the_tag_at_the_end_is_held():
    texts = ("ab", "a<", "a</thin", "</think>", "<</", "")
    assert [ready_and_held(t, "</think>") for t in texts] == [
        ("ab", ""), ("a", "<"), ("a", "</thin"), ("</think>", ""), ("<", "</"), ("", ""),
    ]  # fmt: skip
