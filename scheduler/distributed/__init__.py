"""Tensor parallelism over torch.distributed: sharded layers, the driver's executor and the workers' loop.

The driver (rank 0) owns the scheduler and the block manager; every step it broadcasts one
host-side payload to the workers, which rebuild the same step input on their device and run
their shard of the model. Collectives: gloo on CPU, NCCL on CUDA (the step payloads always
travel over a gloo group).
"""

from scheduler.distributed.parallel_state import TPShard

__all__ = ["TPShard"]
