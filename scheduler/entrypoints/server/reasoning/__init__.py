"""Reasoning outputs on chat completions (vLLM's ``--reasoning-parser``): the thinking split out of the answer.

- ``reader``: the incremental reader of a sample's text into reasoning and content, and the parsers' tags and rules.
- ``output``: where a request's constraint starts (after the end tag's tokens, ``end_tag_ids``) and its messages'
  and deltas' ``reasoning`` fields (``ReasoningOutput``).
"""
