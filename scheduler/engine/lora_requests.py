"""LoRA adapters of the engine's requests: staged (read, keyed) before admission, kept loaded once queued.

A request's adapter is staged first (:meth:`LoRARequests.stage`: its key and weights, nothing loaded), so
that its admission checks see the adapter's cache salt and a refused request loads nothing; a queued request's
adapter is then kept loaded (:meth:`LoRARequests.keep`) and named to the KV events (the root of its blocks'
hash chains names the adapter).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from paged_kv.block_hash import salt_root
from paged_kv.errors import InvalidArgumentError, describe
from scheduler.core.lora_request import LoRAKey, LoRARequest
from scheduler.core.sequence import SequenceGroup
from scheduler.engine.cache_events import CacheEvents
from scheduler.model.lora_adapter import LoRAAdapter
from scheduler.runner.lora_manager import ReadLoRA
from scheduler.runner.model_runner import ModelRunner

Staged = tuple[LoRAKey, LoRAAdapter]  # an adapter's key and weights, read but not loaded


class LoRARequests:
    """Stages and keeps the adapters of an engine's requests through its runner's ``LoRAManager``."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner  # its ``loras`` (None: LoRA off) is read at each call

    def stage(self, lora_request: LoRARequest | ReadLoRA | None) -> Staged | None:
        """A request's adapter key and weights, nothing loaded yet (:meth:`LoRAManager.stage`); None: the base model."""
        if lora_request is None:
            return None
        loras = self.runner.loras
        if loras is None:
            raise InvalidArgumentError(describe("lora_request", lora_request,
                                                "None: LoRA is off (EngineConfig.lora_config, --enable-lora)"))
        return loras.stage(lora_request)

    def stage_each(self, lora_request: Seq[LoRARequest | None]) -> list[tuple[LoRAKey | None, ReadLoRA | None]]:
        """Each request's adapter staged, each adapter read once: its key and its weights read; (None, None) for the
        base model. Typed errors."""
        if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Seq):
            raise InvalidArgumentError(describe("lora_request", type(lora_request).__name__,
                                                "a list of LoRARequest or None, one per request"))
        bad = next((r for r in lora_request if r is not None and not isinstance(r, LoRARequest)), None)
        if bad is not None:
            raise InvalidArgumentError(describe("lora_request", bad, "a LoRARequest or None"))
        staged = {r: self.stage(r) for r in dict.fromkeys(lora_request)}
        return [(None, None) if r is None else (staged[r][0], ReadLoRA(request=r, adapter=staged[r][1]))
                for r in lora_request]  # fmt: skip

    def load(self, lora_request: LoRARequest | ReadLoRA | None) -> LoRAKey | None:
        """A request's adapter staged and kept loaded; its key (None: the base model)."""
        staged = self.stage(lora_request)
        if staged is None:
            return None
        self.runner.loras.keep(*staged)
        return staged[0]

    def keep(self, staged: Staged | None, group: SequenceGroup, events: CacheEvents | None) -> None:
        """A queued request's adapter kept loaded (most recently requested), and named to the KV events."""
        if staged is None:
            return
        self.runner.loras.keep(*staged)
        if events is not None:  # the root of its blocks' hash chains names the adapter
            events.name_root(salt_root(group.cache_salt), group.lora.name, group.lora.lora_id)
