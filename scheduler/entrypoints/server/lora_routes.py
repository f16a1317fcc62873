"""LoRA adapters served as models: loaded at start-up, and vLLM's runtime load/unload endpoints.

:func:`load_lora_modules` loads every ``--lora-modules`` adapter into the engine before the server
starts (a bad one is a typed error naming it; the engine must have LoRA on). With
``allow_runtime_lora_updating`` (vLLM gates the same endpoints behind its
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` environment variable) :func:`add_lora_routes` serves
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (the adapter is read and checked in a
worker thread, then kept loaded on the engine thread between two steps; 400 for a bad one or a name
already served) and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (404 for a name not served). Requests already
queued through an unloaded adapter finish through it.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from paged_kv.errors import InvalidArgumentError, describe
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.server.async_engine import AsyncEngine
from scheduler.entrypoints.server.config import LoRAModule, ServerConfig
from scheduler.entrypoints.server.errors import NotFound
from scheduler.entrypoints.server.frontend import Frontend

log = logging.getLogger("paged_kv.server")


class LoadLoRARequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's, ignored: the name says which


def load_lora_modules(llm: LLM, config: ServerConfig) -> None:
    """Load every adapter of ``config.lora_modules`` into ``llm``'s engine (before it serves); typed errors."""
    if (config.lora_modules or config.allow_runtime_lora_updating) and llm.engine.runner.loras is None:
        field = "lora_modules" if config.lora_modules else "allow_runtime_lora_updating"
        raise InvalidArgumentError(describe(field, True, "used with an engine that serves LoRA (--enable-lora)"))
    for module in config.lora_modules:
        llm.engine.load_lora(module.request)
        log.info("LoRA adapter %r served from %s", module.name, module.path)


def add_lora_routes(v1: APIRouter, front: Frontend, engine: AsyncEngine) -> None:
    """Add vLLM's runtime LoRA endpoints to the ``/v1`` router."""

    @v1.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRARequest) -> str:
        """Load an adapter and serve it under ``lora_name``; 400 for a name already served or a bad adapter."""
        if body.lora_name in front.loras or body.lora_name in front.names:
            raise InvalidArgumentError(describe("lora_name", body.lora_name, "a name not served yet"))
        module = LoRAModule(name=body.lora_name, path=body.lora_path)
        read = await engine.read_lora(module.request)  # the files off the engine thread: no step waits on them
        await engine.call(lambda: front.llm.engine.load_lora(read))
        front.loras[module.name] = module
        log.info("LoRA adapter %r loaded from %s", module.name, module.path)
        return f"Success: LoRA adapter '{module.name}' added successfully."

    @v1.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRARequest) -> str:
        """Stop serving an adapter (and drop it from host memory); 404 for a name not served."""
        if front.loras.pop(body.lora_name, None) is None:
            raise NotFound("lora_name", describe("lora_name", body.lora_name, f"a served adapter {list(front.loras)}"))
        loras = front.llm.engine.runner.loras
        await engine.call(lambda: loras.key(body.lora_name) is not None and loras.unload(body.lora_name))
        log.info("LoRA adapter %r unloaded", body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
