"""The look-ahead buffer of one data-parallel rank: samples pulled from Energon's savable loader and not served yet,
and one online ISF step over it.  Shared by the trainer's stream (``stream.SampleStream``) and the drop-in balancer
(``balancing.OnlineISFLoader``).

A buffered sample is any object with a ``cost`` (``SampleCost``: computed in the loader's workers from cheap metadata)
and Energon's ``__restore_key__``.  ``LookAhead`` keeps the samples oldest first with their costs' table
(``BufferCosts``), updated as samples come and go rather than rebuilt every step; its ``restore_keys`` are what a
checkpoint saves of it (the samples have left the loader already: ``restored`` fetches them again with
``SavableDataLoader.restore_sample``, in the same order).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from omnibal_ext.data.online_isf import BufferCosts, Exchange, OnlineISF, OnlineOversizeError
from omnibal_ext.errors import UserError


class LookAhead:
    """Samples pulled, not served, oldest first (``samples``), and their costs as arrays (``costs``)."""

    def __init__(self, samples: Sequence[Any] = ()):
        self.samples: list[Any] = list(samples)
        self.costs = BufferCosts.from_costs([s.cost for s in self.samples])

    @classmethod
    def restored(cls, loader, keys: Sequence) -> "LookAhead":
        """The buffer whose ``restore_keys`` were ``keys``, fetched again from ``loader`` (the same samples in the same
        order; keys that a JSON round trip turned into lists are taken as Energon's tuples)."""
        return cls([loader.restore_sample(restore_key(key)) for key in keys])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> Any:
        return self.samples[position]

    def append(self, new: Sequence[Any]) -> None:
        """Newly pulled samples, at the end."""
        if new:
            self.samples += new
            self.costs = self.costs.concat(BufferCosts.from_costs([s.cost for s in new]))

    def take(self, positions: Sequence[int]) -> list[Any]:
        """Serve the samples at ``positions`` (in that order); they leave the buffer, the others keep their order."""
        n = len(self.samples)
        if len(set(positions)) != len(positions) or any(not 0 <= p < n for p in positions):
            raise ValueError(f"LookAhead.take: positions {list(positions)} are not distinct positions of a buffer of "
                             f"{n}")
        chosen = [self.samples[p] for p in positions]
        kept = np.ones(n, dtype=bool)
        kept[list(positions)] = False
        self.samples = [s for s, keep in zip(self.samples, kept) if keep]
        self.costs = self.costs.take(np.flatnonzero(kept))
        return chosen

    def restore_keys(self) -> list:
        """Energon's restore key of every buffered sample, oldest first (what a checkpoint saves of the buffer)."""
        return [s.__restore_key__ for s in self.samples]


def balanced_step(isf: OnlineISF, buffer: LookAhead, exchange: Exchange, final: bool,
                  name: Callable[[Any], str], hint: str = "") -> list[list[Any]]:
    """This rank's groups of one step: ``isf.next_step_groups`` over the buffer's costs (``final``: the stream has
    ended, the buffer drains), the samples served taken out of the buffer.  Every rank calls it once per step (it
    all-gathers through ``exchange``).  A sample over a count cap is refused as ``name(sample): reason`` + ``hint``."""
    try:
        positions = isf.next_step_groups(buffer.costs, exchange, final=final)
    except OnlineOversizeError as e:
        raise UserError(f"{name(buffer[e.position])}: {e}{hint}") from None
    chosen = buffer.take([p for g in positions for p in g])
    groups, start = [], 0
    for g in positions:
        groups.append(chosen[start:start + len(g)])
        start += len(g)
    return groups


def restore_key(key) -> tuple:
    """A restore key as Energon takes it (nested tuples), from one a JSON round trip turned into lists."""
    return tuple(restore_key(k) if isinstance(k, list) else k for k in key)
