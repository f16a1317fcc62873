"""Tensor-parallel process groups and collectives over torch.distributed (gloo on CPU, NCCL on CUDA).

The model's parallel layers (:mod:`scheduler.model.parallel_layers`) call these collectives; the
driver's executor and the workers' loop (:mod:`scheduler.runner.tp_executor`,
:mod:`scheduler.runner.tp_worker`) set the groups up and broadcast each step over them.
"""

from scheduler.distributed.parallel_state import TPShard

__all__ = ["TPShard"]
