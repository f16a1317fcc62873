"""The device->host transfer of a step's results: whatever the step reads back comes in one copy.

On a GPU every transfer is a sync point. A producer of device results (the sampler, the verification of drafts)
returns a :class:`Fetch`: its device tensors and how its result reads from their values on the host.
:func:`fetch` concatenates the tensors of several fetches (as float64: token ids below ``2**53`` are exact), copies
them to the host once and gives each fetch its own slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Fetch(Generic[T]):
    """Device results not read back yet: the tensors, and how their values (flat, on the host) read."""

    parts: list[torch.Tensor]
    read: Callable[[list[float]], T]

    @property
    def size(self) -> int:
        """Values this fetch takes of the transfer (its tensors' elements: known without a sync)."""
        return sum(p.numel() for p in self.parts)

    def then(self, after: Callable[[T], U]) -> Fetch[U]:
        """This fetch with ``after`` applied to what it reads."""
        return Fetch(self.parts, lambda host: after(self.read(host)))


def fetch(*fetches: Fetch[Any]) -> list[Any]:
    """What each of ``fetches`` reads, all brought to the host in one device->host transfer (none: no transfer)."""
    parts = [p.reshape(-1).double() for f in fetches for p in f.parts]
    host = torch.cat(parts).tolist() if parts else []  # the one device->host transfer
    out, at = [], 0
    for f in fetches:
        out.append(f.read(host[at : at + f.size]))
        at += f.size
    return out
