"""The paged machinery every compatibility facade stands on.

A :class:`KVPool` is one block manager plus the paged storage it governs; any
number of facade caches can share one. A :class:`PagedSeq` is one facade's
sequence in that pool: it grows page by page, writes and reads K/V by
position, truncates, drops whole leading pages (a sliding window) and forks
copy-on-write. A private pool (the default when a facade gets no ``pool=``)
starts small and doubles when it runs out, so memory follows the tokens held,
never ``max_seq_len``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from paged_kv.block_manager import BlockManager
from paged_kv.config import BlockManagerConfig
from paged_kv.errors import InvalidArgumentError, OutOfBlocksError, check_int, check_type, describe
from paged_kv.kv_cache import KVCacheSpec, PagedKVCache
from paged_kv.tensor_checks import check_tensor

_INITIAL_BLOCKS = 4


class KVPool:
    """A block manager and its paged K/V storage, shareable between facade caches."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        num_blocks: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.spec = KVCacheSpec(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype
        )
        self.growable = num_blocks is None
        n = _INITIAL_BLOCKS if num_blocks is None else num_blocks
        self.manager = BlockManager(
            BlockManagerConfig(num_blocks=n, block_size=block_size, watermark=0.0, enable_prefix_caching=False)
        )
        self.storage = PagedKVCache(self.spec, n, device)
        self._ids = itertools.count()

    @property
    def block_size(self) -> int:
        """Token slots per page."""
        return self.spec.block_size

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page holds over all layers, K and V, scales included."""
        return self.spec.bytes_per_block

    def compatible(self, **kwargs: object) -> None:
        """Raise unless this pool's geometry matches the facade's (num_layers=..., head_dim=...)."""
        for name, want in kwargs.items():
            if name not in KVCacheSpec.__dataclass_fields__:
                fields = ", ".join(KVCacheSpec.__dataclass_fields__)
                raise InvalidArgumentError(describe(name, want, f"a KVCacheSpec field ({fields})"))
            if name != "dtype":  # numpy ints are sizes too; 2.0 is no layer count, True no head_dim
                want = check_int(name, want, low=1)
            have = getattr(self.spec, name)
            if have != want:
                raise InvalidArgumentError(describe(f"pool.{name}", have, f"{want} to match the cache"))

    def add_layers(self, num_layers: int) -> None:
        """Give every page ``num_layers`` more (zeroed) layers, for a cache that learns its layer count lazily."""
        self.storage.add_layers(num_layers)
        self.spec = self.storage.spec

    def new_seq(self) -> PagedSeq:
        """A new empty sequence in this pool."""
        return PagedSeq(self, None)

    def ensure_free(self, num_blocks: int) -> None:
        """Make ``num_blocks`` free: grow a private pool (doubling), or raise for a fixed one."""
        check_int("num_blocks", num_blocks, low=0)
        free = self.manager.num_free_blocks
        if num_blocks <= free:
            return
        if not self.growable:
            raise OutOfBlocksError(f"pool: needs num_blocks={num_blocks} free pages, expected at most {free}")
        extra = max(num_blocks - free, self.manager.gpu.num_blocks)
        self.storage.grow(extra)
        self.manager.add_blocks(extra)


class PagedSeq:
    """One sequence of pages in a :class:`KVPool`, addressed by token position."""

    def __init__(self, pool: KVPool, parent: PagedSeq | None) -> None:
        check_type("pool", pool, KVPool, "a KVPool")
        if parent is not None and (not isinstance(parent, PagedSeq) or parent.pool is not pool):
            raise InvalidArgumentError(describe("parent", parent, "None or a PagedSeq of the same pool"))
        self.pool = pool
        self.seq_id = next(pool._ids)
        manager = pool.manager
        if parent is None:
            manager.allocate(self.seq_id, 0)
        else:
            manager.fork(parent.seq_id, self.seq_id)
        self._finalizer = weakref.finalize(self, manager.free, self.seq_id)

    @property
    def length(self) -> int:
        """Positions with reserved slots."""
        return self.pool.manager.num_tokens(self.seq_id)

    @property
    def num_pages(self) -> int:
        """Pages this sequence references (shared pages counted once per sequence)."""
        return len(self.pool.manager.block_table(self.seq_id))

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this sequence references, scales included."""
        return self.num_pages * self.pool.bytes_per_page

    def block_table(self) -> list[int]:
        """The sequence's physical pages in logical order."""
        return self.pool.manager.block_table(self.seq_id)

    def pages_to_append(self, n: int) -> int:
        """Free pages ``extend(n)`` takes: new pages plus a private copy of a shared last page."""
        check_int("n", n, low=0)
        return self.pool.manager.num_blocks_to_append(self.seq_id, n)

    def extend(self, n: int) -> int:
        """Reserve slots for ``n`` more positions; return the first new position."""
        start = self.length
        self.pool.ensure_free(self.pages_to_append(n))  # raises (nothing changed) in a full fixed pool
        self.pool.storage.copy_blocks(self.pool.manager.append(self.seq_id, n))
        return start

    def write(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write K/V ``[T, H, D]`` at positions ``[start, start + T)`` (all below ``length``)."""
        check_int("start", start, low=0)
        check_tensor("key", key, ndim=3)
        end = start + key.shape[0]
        check_int("start", start, low=0, high=max(self.length - key.shape[0], 0))
        manager = self.pool.manager
        if not manager.can_prepare_write(self.seq_id, start, end):
            self.pool.ensure_free(self._pages_for(start, end))
        self.pool.storage.copy_blocks(manager.prepare_write(self.seq_id, start, end))
        slots = self.pool.storage.slots(self.block_table(), start, end)
        self.pool.storage.write(layer, key, value, slots)

    def read(self, layer: int, start: int = 0, end: int | None = None, dtype: torch.dtype | None = None):
        """K/V of positions ``[start, end)`` as two ``[T, H, D]`` tensors (dequantized)."""
        end = self.length if end is None else end
        check_int("end", end, low=0, high=self.length)
        check_int("start", start, low=0, high=end)
        return self.pool.storage.gather(layer, self.block_table(), start, end, dtype)

    def _pages_for(self, start: int, end: int) -> int:
        """An upper bound on the pages touched by positions ``[start, end)``."""
        bs = self.pool.block_size
        return -(-end // bs) - start // bs

    def truncate(self, n: int) -> None:
        """Keep positions ``[0, n)``; whole pages past them return to the pool."""
        self.pool.manager.truncate(self.seq_id, n)

    def drop_front(self, num_pages: int) -> None:
        """Give the first ``num_pages`` pages back; position ``p`` becomes ``p - num_pages * block_size``."""
        check_int("num_pages", num_pages, low=0, high=self.num_pages)
        self.pool.manager.drop_front(self.seq_id, num_pages)

    def fork(self) -> PagedSeq:
        """A copy-on-write copy: O(pages), the two diverge safely on their next writes."""
        return PagedSeq(self.pool, self)

    def free(self) -> None:
        """Return every page to the pool (idempotent)."""
        self._finalizer()
