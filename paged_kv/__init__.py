"""paged-kv: a paged KV-cache manager for LLM inference."""

from paged_kv.block_manager import BlockManager, CopyOp, SeqId
from paged_kv.config import BlockManagerConfig
from paged_kv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    OutOfRangeError,
    PagedKVError,
    SequenceStateError,
    UnknownSequenceError,
    WorkerError,
)
from paged_kv.stats import BlockManagerStats

__all__ = [
    "BlockManager", "BlockManagerConfig", "BlockManagerStats", "CopyOp", "SeqId",
    "PagedKVError", "InvalidArgumentError", "OutOfRangeError", "OutOfBlocksError",
    "UnknownSequenceError", "DuplicateSequenceError", "SequenceStateError", "WorkerError",
]
