"""``POST /v1/embeddings`` (OpenAI's API, with vLLM's ``truncate_prompt_tokens``, ``add_special_tokens`` and
``priority``), served with ``ServerConfig.convert == "embed"`` (``--convert embed``) by the same engine as the
generation endpoints.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists; each becomes one
embedding request of the engine (:mod:`scheduler.engine.pooler`: pooled as the engine's ``PoolerConfig`` says),
returned in input order as floats or, with ``encoding_format="base64"``, as the base64 of little-endian float32
bytes (OpenAI's encoding, the official client's default). ``dimensions`` is honoured on a Matryoshka model only
(``PoolerConfig.is_matryoshka``), else a 400 naming it; an empty input, an empty string, a token id outside the
vocabulary or a prompt longer than ``max_model_len`` is a 400 naming ``input``. ``user`` is logged. A query
instruction (Qwen3-Embedding's ``Instruct: ...\\nQuery: ...``) is the client's to write into its text.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import time
import uuid
from typing import Literal

from pydantic import Field, field_validator

from paged_kv.errors import PagedKVError, describe
from scheduler.core.outputs import EmbeddingRequestOutput
from scheduler.core.pooling_params import MAX_DIMENSIONS, PoolingParams
from scheduler.entrypoints.server.frontend import Frontend
from scheduler.entrypoints.server.openai_model import OpenAIModel
from scheduler.entrypoints.server.protocol import INT64_MAX, INT64_MIN, TokenId
from scheduler.entrypoints.server.sampling import FieldError

log = logging.getLogger("paged_kv.server")


class EmbeddingRequest(OpenAIModel):
    """``POST /v1/embeddings``."""

    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None  # vLLM: optional, the first served name
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_DIMENSIONS)  # Matryoshka models only
    user: str | None = None  # an end-user id: logged with the request
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # keep the last that many (-1: max_model_len)
    add_special_tokens: bool = True  # the tokenizer's special tokens around a text input (vLLM's default)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # lower is more important

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, str):
            value = [value]
        if not value or any(isinstance(p, (str, list)) and not p for p in value):  # empty: a list, string, id list
            raise ValueError("input must be non-empty (and so must each of its strings and token lists)")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs: each string or token-id list is one."""
        if isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


async def prepare_embeddings(front: Frontend, body: EmbeddingRequest
                             ) -> tuple[str, str, list[tuple[list[int], None]], PoolingParams]:  # fmt: skip
    """A validated request's id, served model name, prompts and pooling parameters; refusals name their field."""
    model = front.model_name(body.model)
    params = _pooling_params(front, body, model)
    if body.truncate_prompt_tokens == 0:
        raise FieldError("truncate_prompt_tokens", describe("truncate_prompt_tokens", 0, "-1, >= 1 or null"))
    prompts = await _prompts(front, body, params)
    rid = f"embd-{uuid.uuid4().hex}"
    if front.config.log_requests:
        log.info("request %s: model %s, user %r, prompt tokens %s, %s", rid, model, body.user,
                 [len(ids) for ids, _ in prompts], params)  # fmt: skip
    return rid, model, prompts, params


def _pooling_params(front: Frontend, body: EmbeddingRequest, model: str) -> PoolingParams:
    """The request's pooling parameters; a 400 naming ``dimensions`` (or ``model``: an adapter) if refused."""
    if model in front.loras:
        raise FieldError("model", describe("model", model, "the base model: embeddings run through no adapter"))
    params = PoolingParams(dimensions=body.dimensions)
    engine = front.llm.engine
    try:
        engine.pooler.config.resolve(params, engine.model.config.hidden_size)
    except PagedKVError as e:
        raise FieldError("dimensions", str(e)) from None
    return params


async def _prompts(front: Frontend, body: EmbeddingRequest, params: PoolingParams) -> list[tuple[list[int], None]]:
    """Each input's token ids (strings tokenized off the event loop), cut to ``truncate_prompt_tokens``, checked
    against the vocabulary, ``max_model_len`` and what the engine can serve (a 400 naming ``input``)."""
    inputs = body.inputs()
    if len(inputs) > front.engine.max_in_flight:  # never admitted: a 400, not a 503 forever
        expected = f"at most {front.engine.max_in_flight} inputs per request (--max-in-flight)"
        raise FieldError("input", describe("input", f"{len(inputs)} inputs", expected))
    encode = lambda: [front.llm.encode(p, add_special_tokens=body.add_special_tokens)[0] for p in inputs]  # noqa: E731
    encoded = await asyncio.get_running_loop().run_in_executor(front.tokenizer_pool, encode)
    keep = front.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
    prompts = [ids[-keep:] if keep is not None else ids for ids in encoded]  # vLLM cuts embeddings' left end
    front.check_in_vocab("input", (i for ids in prompts for i in ids))
    for i, ids in enumerate(prompts):
        if not ids or len(ids) > front.max_model_len:
            expected = f"1 to max_model_len={front.max_model_len} tokens"
            raise FieldError("input", describe(f"input[{i}]", f"{len(ids)} tokens", expected))
        try:
            front.engine.check(ids, params)
        except PagedKVError as e:
            raise FieldError("input", f"input[{i}]: {e}") from None
    return [(ids, None) for ids in prompts]


def embeddings_response(rid: str, model: str, results: list[EmbeddingRequestOutput], encoding_format: str) -> dict:
    """OpenAI's embeddings body: one item per input, and the prompt tokens as the usage."""
    encode = _base64 if encoding_format == "base64" else list
    data = [{"index": i, "object": "embedding", "embedding": encode(r.outputs.embedding)}
            for i, r in enumerate(results)]  # fmt: skip
    tokens = sum(len(r.prompt_token_ids) for r in results)
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _base64(vector: list[float]) -> str:
    """A vector as OpenAI's base64 encoding: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
