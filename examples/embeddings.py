"""Embeddings through the official OpenAI client: cosine similarities of a few sentences (SmolLM2, in seconds).

Starts its own server in a background thread (``--convert embed``: ``/v1/embeddings`` beside generation, one
engine), asks for every sentence's vector (the last token's final hidden state, L2-normalized) and prints the
similarity of each pair; then one completion on the same server. SmolLM2 is no embedding model: the numbers show
the mechanics, not retrieval quality (serve a Qwen3-Embedding checkpoint for that, with its query instruction
written into the text by the client).
"""

from __future__ import annotations

import itertools

from openai import OpenAI

from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.server.app import build_app
from scheduler.entrypoints.server.background import serve_in_thread
from scheduler.entrypoints.server.config import ServerConfig

SENTENCES = [
    "The cat sleeps on the warm windowsill.",
    "A kitten naps in the sun by the window.",
    "Interest rates rose again this quarter.",
]


def main() -> None:
    """Serve SmolLM2 with embeddings on, embed the sentences, print each pair's cosine similarity."""
    llm = LLM(engine_config=EngineConfig(cache=CacheConfig(block_size=16, num_gpu_blocks=64), device="cpu"))
    app = build_app(llm, ServerConfig(convert="embed", log_requests=False))
    with serve_in_thread(app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        r = client.embeddings.create(model=model, input=SENTENCES)  # the client asks for base64 and decodes it
        vectors = [d.embedding for d in r.data]
        print(f"{len(vectors)} vectors of {len(vectors[0])} floats, {r.usage.prompt_tokens} prompt tokens")
        for (i, a), (j, b) in itertools.combinations(enumerate(vectors), 2):
            cosine = sum(x * y for x, y in zip(a, b))  # unit vectors: the dot product is the cosine
            print(f"{cosine:+.3f}  {SENTENCES[i]!r} ~ {SENTENCES[j]!r}")
        answer = client.completions.create(model=model, prompt="The cat", max_tokens=8, temperature=0)
        print(f"and generation on the same engine: 'The cat{answer.choices[0].text}'")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
