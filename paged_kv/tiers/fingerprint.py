"""What makes stored KV blocks usable by a model: its geometry, storage dtype and block-hash scheme."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from paged_kv.block_hash import HASH_SCHEME
from paged_kv.config import MAX_BLOCK_SIZE
from paged_kv.errors import InvalidArgumentError, check_int, check_type, describe

if TYPE_CHECKING:
    from paged_kv.kv_cache import KVCacheSpec

FORMAT_VERSION = "paged-kv/disk/v1"
DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "uint8", "int8", "float8_e4m3fn", "float8_e5m2")}  # fmt: skip
QUANTIZED = ("int8", "float8_e4m3fn", "float8_e5m2")  # codes with one float32 scale per (token, head)
_INT_FIELDS = {"num_layers": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 14, "block_size": MAX_BLOCK_SIZE}


@dataclass(frozen=True, kw_only=True)
class ModelFingerprint:
    """Identifies the model whose KV blocks a file holds; blocks are shared only between equal fingerprints."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a storage dtype's name, e.g. "bfloat16"
    block_size: int
    hash_scheme: str = HASH_SCHEME  # how block hashes chain, e.g. "sha256:paged-kv/block/v1"

    def __post_init__(self) -> None:
        for name in ("architecture", "hash_scheme"):
            value = getattr(self, name)
            check_type(name, value, str, "a str")
            if not value.strip():
                raise InvalidArgumentError(describe(name, value, "a non-empty str"))
        for name, high in _INT_FIELDS.items():
            check_int(name, getattr(self, name), low=1, high=high)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise InvalidArgumentError(describe("dtype", self.dtype, f"one of {sorted(DTYPES)}"))

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, architecture: str) -> ModelFingerprint:
        """The fingerprint of a paged cache's spec for a model ``architecture``."""
        from paged_kv.kv_cache import KVCacheSpec  # here: the storage module imports the kernels

        check_type("spec", spec, KVCacheSpec, "a KVCacheSpec")
        dtype = str(spec.dtype).removeprefix("torch.")
        return cls(architecture=architecture, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, dtype=dtype, block_size=spec.block_size)  # fmt: skip

    def to_metadata(self) -> dict[str, str]:
        """The fields as safetensors metadata (str to str)."""
        return {name: str(value) for name, value in asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> ModelFingerprint:
        """The fingerprint stored in safetensors metadata (InvalidArgumentError if a field is missing or bad)."""
        names = ("architecture", "dtype", "hash_scheme", *_INT_FIELDS)
        missing = [n for n in names if not isinstance(meta.get(n), str)]
        if missing:
            raise InvalidArgumentError(describe("meta", sorted(meta), f"string entries {missing} as well"))
        ints = {n: _strict_int(n, meta[n]) for n in _INT_FIELDS}
        return cls(architecture=meta["architecture"], dtype=meta["dtype"], hash_scheme=meta["hash_scheme"], **ints)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The storage dtype as a torch dtype."""
        return DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        """Whether blocks hold int8/fp8 codes with float32 scales."""
        return self.dtype in QUANTIZED

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """One block's K and V over all layers: [2, num_layers, block_size, num_kv_heads, head_dim]."""
        return (2, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int, int]:
        """One block's scales (quantized dtypes): [2, num_layers, block_size, num_kv_heads]."""
        return self.kv_shape[:4]

    @property
    def bytes_per_block(self) -> int:
        """Tensor bytes of one block, scales included."""
        n = 2 * self.num_layers * self.block_size * self.num_kv_heads
        return n * self.head_dim * self.torch_dtype.itemsize + (4 * n if self.quantized else 0)

    @cached_property
    def tag(self) -> str:
        """16 hex digits naming this model (and file format) in file names."""
        body = json.dumps(self.to_metadata() | {"format": FORMAT_VERSION}, sort_keys=True).encode("utf-8")
        return hashlib.blake2b(body, digest_size=8).hexdigest()


def _strict_int(name: str, text: str) -> int:
    """A decimal integer written without sign, spaces or leading zeros."""
    if not text.isascii() or not text.isdigit() or str(int(text)) != text:
        raise InvalidArgumentError(describe(name, text, "a decimal integer"))
    return int(text)
