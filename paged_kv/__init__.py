"""paged-kv: a paged KV-cache manager for LLM inference."""

from paged_kv.block_hash import BlockHashes
from paged_kv.block_manager import RELEASED, Admission, BlockManager, CopyOp, SeqId, TableEntry
from paged_kv.config import BlockManagerConfig
from paged_kv.errors import (
    ClosedError,
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
    "BlockManager", "BlockManagerConfig", "BlockManagerStats", "BlockHashes", "Admission", "CopyOp", "SeqId",
    "TableEntry", "RELEASED",
    "PagedKVError", "ClosedError", "InvalidArgumentError", "OutOfRangeError", "OutOfBlocksError",
    "UnknownSequenceError", "DuplicateSequenceError", "SequenceStateError", "WorkerError",
]
