"""The official OpenAI client against a running ``paged-kv serve``: a streamed chat answer (starts no server).

Start the server first (``.venv/bin/paged-kv serve``), then run this; the
answer streams in as the engine samples it. ``PAGED_KV_URL`` overrides the
default address ``http://127.0.0.1:8000/v1``.
"""

from __future__ import annotations

import os
import sys

from openai import APIConnectionError, OpenAI


def connect() -> tuple[OpenAI, str]:
    """A client of the server at ``PAGED_KV_URL`` and the name of the model it serves (exits if none answers)."""
    client = OpenAI(base_url=os.environ.get("PAGED_KV_URL", "http://127.0.0.1:8000/v1"), api_key="unused")
    try:
        return client, client.models.list().data[0].id
    except APIConnectionError:
        sys.exit(f"no server at {client.base_url}: start one with `.venv/bin/paged-kv serve`")


def main() -> None:
    """Ask one question and print the answer as it streams."""
    client, model = connect()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me one sentence about the ocean."}],
        max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} generated tokens]")


if __name__ == "__main__":
    main()
