"""The official OpenAI client's Responses API against a running ``paged-kv serve`` (starts no server).

Start the server first (``.venv/bin/paged-kv serve``), then run this. A first response is streamed
(its last event, ``response.completed`` or ``response.incomplete``, carries the whole response); a
second one continues the conversation through ``previous_response_id`` (the server keeps finished
responses in memory); then both are deleted.
``PAGED_KV_URL`` overrides the default address ``http://127.0.0.1:8000/v1`` (as for ``openai_client.py``).
"""

from __future__ import annotations

from openai_client import connect  # this folder's: the client and the served model


def main() -> None:
    """Stream one answer, continue the conversation from it, print the usage, delete both responses."""
    client, model = connect()
    stream = client.responses.create(model=model, instructions="Answer in one sentence.", input="What is a tide?",
                                     max_output_tokens=48, temperature=0, stream=True)  # fmt: skip
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
        elif event.type in ("response.completed", "response.incomplete"):
            first = event.response
    print(f"\n[{first.id}: {first.status}]")
    second = client.responses.create(model=model, previous_response_id=first.id, input="And what causes it?",
                                     max_output_tokens=48, temperature=0)  # fmt: skip
    print(second.output_text)
    print(f"[{second.usage.input_tokens} input tokens (the first turn included), {second.usage.output_tokens} output]")
    for response in (first, second):
        client.responses.delete(response.id)


if __name__ == "__main__":
    main()
