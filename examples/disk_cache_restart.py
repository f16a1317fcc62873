"""A prefix cache that survives a restart: SmolLM2 reads a long document, restarts, and finds it on disk.

The first engine answers a question about a document (computing all of it), then shuts down:
its cached blocks are written to a disk tier in a directory. A second engine on the same
directory answers another question about the same document: the document's blocks come back
from disk (counted as cached tokens) and only the question is computed.

    python examples/disk_cache_restart.py
"""

from __future__ import annotations

import tempfile

import torch

from scheduler import CacheConfig, EngineConfig, SamplingParams
from scheduler.entrypoints.llm import LLM
from scheduler.model.loader import LoadedModel, load_smollm2

DOCUMENT = " ".join(
    f"Entry {i}: the lighthouse keeper logged wind from the {d}, {c} skies and {s} passing ships."
    for i, (d, c, s) in enumerate(zip(["north", "west", "south", "east"] * 8, ["grey", "clear", "stormy", "misty"] * 8,
                                      ["two", "no", "three", "five"] * 8))  # fmt: skip
)


def ask(llm: LLM, question: str) -> None:
    """Ask about the document; print the answer, the time to first token and the tokens found cached."""
    prompt = llm.chat_prompt([{"role": "system", "content": DOCUMENT}, {"role": "user", "content": question}])
    out = llm.engine.generate([prompt], SamplingParams(max_tokens=24), use_tqdm=False)[0]
    ttft = (out.first_token_time - out.arrival_time) * 1e3
    answer = llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True).strip()
    print(f"  {question}\n  -> {answer}")
    print(f"  TTFT {ttft:.0f} ms, {out.num_cached_tokens} of {len(prompt)} prompt tokens cached")


def main() -> None:
    """Ask one engine, shut it down, then ask a second engine on the same disk directory."""
    torch.set_num_threads(2)
    hf, tokenizer = load_smollm2()
    loaded = LoadedModel(hf, tokenizer, "SmolLM2")
    with tempfile.TemporaryDirectory(prefix="paged-kv-disk-") as directory:
        cache = CacheConfig(kv_offloading_bytes=256 << 20, kv_disk_dir=directory, kv_disk_bytes=1 << 30)
        for name, question in (("first engine", "Which ships passed on the stormy days?"),
                               ("restarted engine, same directory", "What did the keeper write down?")):  # fmt: skip
            print(name)
            llm = LLM(loaded, engine_config=EngineConfig(cache=cache, device="cpu"))
            ask(llm, question)
            llm.engine.shutdown()  # the cached blocks go to disk


if __name__ == "__main__":
    main()
