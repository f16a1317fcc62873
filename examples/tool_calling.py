"""The official OpenAI client against a running ``paged-kv serve``: a streamed tool call (starts no server).

Start the server first (``.venv/bin/paged-kv serve``), then run this. The request names the
function to call (``tool_choice``), so the server holds the answer to the function's parameters
schema: the call's arguments stream in as the engine samples them, then are parsed as JSON.
``PAGED_KV_URL`` overrides the default address ``http://127.0.0.1:8000/v1`` (as for ``openai_client.py``).
"""

from __future__ import annotations

import json

from openai_client import connect  # this folder's: the client and the served model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def main() -> None:
    """Ask for the weather with get_weather as the tool to call; print the call as it streams, then its arguments."""
    client, model = connect()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=128, temperature=0, stream=True,
    )  # fmt: skip
    arguments = ""
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function.name:  # a call's first delta names it
                print(f"call {call.id}: {call.function.name}(", end="", flush=True)
            arguments += call.function.arguments or ""
            print(call.function.arguments or "", end="", flush=True)
    print(")")
    print("parsed arguments:", json.loads(arguments))


if __name__ == "__main__":
    main()
