"""LoRA adapters as requests name them (:class:`LoRARequest`) and as the engine keys them (:class:`LoRAKey`).

A request served through an adapter carries a :class:`LoRARequest` (``LoRARequest(name="sql",
path="/adapters/sql")``). vLLM's is positional ``LoRARequest(lora_name, lora_int_id, lora_path)``;
ours is keyword-only and has no id to choose: the engine numbers adapters itself (1, 2, ... in
the order their names are first loaded; vLLM's ``lora_int_id`` is the caller's), and that number
is the ``lora_id`` of its KV events.

Once loaded, an adapter is a :class:`LoRAKey`: its name, id, and a fingerprint of its files. The
key roots the request's block-hash chain (:meth:`LoRAKey.cache_salt`), so blocks computed under
one adapter are never served to another adapter or to the base model, nor to the same name
reloaded with other weights (vLLM keys by name alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from paged_kv.errors import InvalidArgumentError, check_int, describe

_SALT_DOMAIN = b"paged-kv/lora/v1"


@dataclass(frozen=True, kw_only=True)
class LoRARequest:
    """A PEFT LoRA adapter a request is served through: its name (unique per engine) and folder."""

    name: str
    path: str  # a folder with adapter_config.json and adapter_model.safetensors

    def __post_init__(self) -> None:
        for field in ("name", "path"):
            value = getattr(self, field)
            if not (isinstance(value, str) and value):
                raise InvalidArgumentError(describe(f"lora_request.{field}", value, "a non-empty str"))


@dataclass(frozen=True, kw_only=True)
class LoRAKey:
    """A loaded adapter's identity: name, the engine's id for it, and the SHA-256 of its files."""

    name: str
    lora_id: int  # >= 1, the engine's number for the name (0 would read as the base model)
    fingerprint: str  # hex digest of adapter_config.json and adapter_model.safetensors
    path: str

    def __post_init__(self) -> None:
        check_int("lora_id", self.lora_id, low=1)

    def cache_salt(self, cache_salt: str | None) -> bytes:
        """The prefix-cache salt of a request through this adapter: bytes, so no user's str salt equals it."""
        return adapter_salt(self.name, self.fingerprint, cache_salt)


def adapter_salt(name: str, fingerprint: str, cache_salt: str | None) -> bytes:
    """The prefix-cache salt of a request through adapter ``name`` with files ``fingerprint`` (the id plays no part,
    so it is known before the engine numbers the adapter)."""
    parts = [_SALT_DOMAIN, name.encode(), fingerprint.encode(), (cache_salt or "").encode()]
    flag = b"S" if cache_salt is not None else b"N"  # salt "" and no salt stay apart
    return flag + b"".join(len(p).to_bytes(8, "little") + p for p in parts)


class SaltsCache(Protocol):
    """An adapter as a request holds it (a LoRAKey, or its files read ahead): it roots the request's block hashes."""

    def cache_salt(self, cache_salt: str | None) -> bytes:
        """The prefix-cache salt of a request through this adapter."""
        ...


def request_salt(cache_salt: str | None, lora: SaltsCache | None) -> str | bytes | None:
    """The root of a request's block hashes: its own ``cache_salt``, under its adapter's key when it has one."""
    return cache_salt if lora is None else lora.cache_salt(cache_salt)


def lora_per_prompt(lora_request: object, n: int) -> list[LoRARequest | None]:
    """Each of ``n`` prompts' adapter: one LoRARequest (or None) for all, or a list of ``n`` of them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)) or len(lora_request) != n:
        raise InvalidArgumentError(describe("lora_request", lora_request,
                                            f"a LoRARequest, None, or a list of {n} of them (one per prompt)"))
    bad = next((r for r in lora_request if r is not None and not isinstance(r, LoRARequest)), None)
    if bad is not None:
        raise InvalidArgumentError(describe("lora_request", bad, "a LoRARequest or None"))
    return list(lora_request)
