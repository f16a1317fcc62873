"""The adapters an engine serves: loaded on request, kept in host memory (LRU), placed in device slots per step.

A request's adapter is taken in two steps, so a refused request leaves no trace: :meth:`LoRAManager.stage`
reads and checks it (:mod:`scheduler.model.lora_adapter`; nothing read if it is loaded from the same
folder) and returns its :class:`~scheduler.core.lora_request.LoRAKey` and weights without changing
anything; once the request is queued, :meth:`LoRAManager.keep` records them (its id for good, most
recently requested). :meth:`LoRAManager.load` does both. :meth:`LoRAManager.read` reads the files on
any thread (the server's handlers, so the engine thread never waits on a disk): its
:class:`ReadLoRA` is staged without reading again. Up to ``max_cpu_loras`` adapters stay loaded, the
least recently requested dropped first (read again from their folder, on the engine thread, checked to
be the same files, if a queued request still needs one). Host memory holds those, plus the adapters
read for requests not yet handed to the engine (one per such request at most; shared when loaded).
:meth:`LoRAManager.step_slots` puts the adapters of a step
into the model's ``max_loras`` device slots (an adapter already in a slot stays there; the slot
used longest ago is reused) and returns each scheduled sequence's slot; the scheduler never puts
more than ``max_loras`` adapters in one step. With tensor parallelism the driver's manager decides alone:
:meth:`LoRAManager.take_loads` hands the step's placements to the payload, and each worker reads those
adapters into the same slots of its shard (:func:`scheduler.runner.tp_worker.load_slot`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from paged_kv.errors import InvalidArgumentError, check_type, describe
from scheduler.core.config import LoRAConfig
from scheduler.core.lora_request import LoRAKey, LoRARequest, adapter_salt
from scheduler.core.scheduler_output import SchedulerOutput
from scheduler.model.llama import LlamaModel
from scheduler.model.lora_adapter import LoRAAdapter, load_adapter
from scheduler.model.lora_layers import LoRASlots, attach_lora


@dataclass(frozen=True, kw_only=True)
class ReadLoRA:
    """A request's adapter with its files read and checked (:meth:`LoRAManager.read`), ready to be staged."""

    request: LoRARequest
    adapter: LoRAAdapter

    def cache_salt(self, cache_salt: str | None) -> bytes:
        """The prefix-cache salt the engine gives a request through this adapter (as its ``LoRAKey``'s)."""
        return adapter_salt(self.request.name, self.adapter.fingerprint, cache_salt)


class LoRAManager:
    """Loaded adapters (host, LRU) and the device slots of the model's projections."""

    def __init__(self, model: LlamaModel, config: LoRAConfig) -> None:
        self.model, self.config = model, config
        self.slots: LoRASlots = attach_lora(model, config.max_loras, config.max_lora_rank)
        self._ids: dict[str, int] = {}  # name -> lora_id, for the engine's life
        self._loaded: OrderedDict[str, tuple[LoRAKey, LoRAAdapter]] = OrderedDict()  # least recent first
        self._in_slot: list[LoRAKey | None] = [None] * config.max_loras
        self._slot_order: list[int] = list(range(config.max_loras))  # least recently used slot first
        self._loads: list[tuple[int, str, str]] = []  # (slot, path, fingerprint) placed since take_loads

    @property
    def names(self) -> list[str]:
        """Names of the adapters loaded now, least recently requested first."""
        return list(self._loaded)

    def key(self, name: str) -> LoRAKey | None:
        """The loaded adapter called ``name``, or None."""
        entry = self._loaded.get(name)
        return entry[0] if entry is not None else None

    def read(self, request: LoRARequest) -> ReadLoRA:
        """The adapter of ``request`` read and checked, on any thread: the loaded one if loaded from the same folder
        (one dict read), else its files; changes nothing (typed errors)."""
        check_type("lora_request", request, LoRARequest, "a LoRARequest")
        entry = self._loaded.get(request.name)  # atomic: the engine thread may move or drop entries meanwhile
        if entry is not None and entry[0].path == request.path:
            return ReadLoRA(request=request, adapter=entry[1])
        return ReadLoRA(request=request, adapter=load_adapter(request.path, self.model.config,
                                                              self.config.max_lora_rank))

    def stage(self, request: LoRARequest | ReadLoRA) -> tuple[LoRAKey, LoRAAdapter]:
        """The key and weights of a request's adapter, read now unless loaded from the same folder or already read;
        nothing changes until :meth:`keep` (typed errors)."""
        read = request if isinstance(request, ReadLoRA) else None
        request = read.request if read is not None else request
        check_type("lora_request", request, LoRARequest, "a LoRARequest (or a ReadLoRA)")
        entry = self._loaded.get(request.name)
        if entry is not None and entry[0].path == request.path:
            if read is None or read.adapter.fingerprint == entry[0].fingerprint:
                return entry
        adapter = read.adapter if read is not None else load_adapter(request.path, self.model.config,
                                                                     self.config.max_lora_rank)  # fmt: skip
        lora_id = self._ids.get(request.name, len(self._ids) + 1)  # the id keep gives a new name
        return LoRAKey(name=request.name, lora_id=lora_id, fingerprint=adapter.fingerprint, path=request.path), adapter

    def keep(self, key: LoRAKey, adapter: LoRAAdapter) -> None:
        """Record an accepted request's staged adapter: its name's id for good, and the most recently requested."""
        self._ids.setdefault(key.name, key.lora_id)
        self._keep(key, adapter)

    def load(self, request: LoRARequest | ReadLoRA) -> LoRAKey:
        """The adapter of ``request`` staged and kept (read now unless loaded from the same folder or already read)."""
        key, adapter = self.stage(request)
        self.keep(key, adapter)
        return key

    def unload(self, name: str) -> None:
        """Forget the loaded adapter ``name`` (requests already queued with it read it again if they need it)."""
        if self._loaded.pop(name, None) is None:
            raise InvalidArgumentError(describe("lora_name", name, f"a loaded adapter ({self.names})"))

    def _keep(self, key: LoRAKey, adapter: LoRAAdapter) -> None:
        """Remember an adapter as the most recent, dropping the least recent beyond ``max_cpu_loras``."""
        self._loaded[key.name] = (key, adapter)
        self._loaded.move_to_end(key.name)
        while len(self._loaded) > self.config.num_cpu_loras:
            self._loaded.popitem(last=False)

    def _adapter(self, key: LoRAKey) -> LoRAAdapter:
        """A step's adapter: loaded, or read again from its folder (the same files, else a typed error)."""
        entry = self._loaded.get(key.name)
        if entry is not None and entry[0] == key:
            return entry[1]
        adapter = load_adapter(key.path, self.model.config, self.config.max_lora_rank)
        if adapter.fingerprint != key.fingerprint:
            raise InvalidArgumentError(describe("lora_request.path", key.path,
                                                f"the files adapter {key.name!r} was loaded from (they changed)"))
        self._keep(key, adapter)
        return adapter

    def step_slots(self, out: SchedulerOutput) -> np.ndarray | None:
        """Each scheduled sequence's device slot (-1: the base model), adapters placed first; None if none runs."""
        keys = [s.group.lora for s in out.scheduled]
        wanted = list(dict.fromkeys(k for k in keys if k is not None))
        if not wanted:
            return None
        if len(wanted) > self.config.max_loras:
            raise InvalidArgumentError(describe("adapters in the step", len(wanted),
                                                f"at most max_loras = {self.config.max_loras}"))
        slot_of = {k: self._place(k, wanted) for k in wanted}
        return np.fromiter((slot_of[k] if k is not None else -1 for k in keys), np.int64, len(keys))

    def take_loads(self) -> tuple[tuple[int, str, str], ...]:
        """The adapters placed in slots since the last call, as (slot, folder, fingerprint): what TP workers load."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def _place(self, key: LoRAKey, wanted: list[LoRAKey]) -> int:
        """The slot holding ``key``, loading it into the least recently used slot no other wanted adapter holds."""
        if key in self._in_slot:
            slot = self._in_slot.index(key)
        else:
            slot = next(s for s in self._slot_order if self._in_slot[s] not in wanted)
            adapter = self._adapter(key)
            self._in_slot[slot] = None  # until the slot holds all of it
            self.slots.load(slot, adapter)
            self._in_slot[slot] = key
            self._loads.append((slot, key.path, key.fingerprint))
        self._slot_order.remove(slot)
        self._slot_order.append(slot)
        return slot
