"""The online ISF balancer around Energon's savable loader: one per data-parallel rank, in its main process.

A drop-in for any Megatron codebase (it names no model family of this fork).  Energon's packing hooks run in the
loader's worker processes, per worker, with no process group; the balance across ranks is done here instead, over
what the loader yields:

* the loader yields ``CostedSample``s (``task_encoder.OnlineISFTaskEncoderMixin``: each sample's cost from cheap
  metadata, media not decoded);
* ``OnlineISFLoader`` keeps a look-ahead buffer of them (``look_ahead.LookAhead``, as the trainer's stream does),
  and every step asks ``OnlineISF`` (``omnibal_ext``) for this rank's groups (``look_ahead.balanced_step``), all
  ranks exchanging one small vector over ``torch.distributed`` (an all-gather of ``SUMMARY_FIELDS`` float64
  numbers per rank, never samples);
* it post-encodes the selected samples (the task encoder's ``postencode_sample``: pixels are decoded only now, in
  ``decode_threads`` threads), groups them (``collate``, default a list) and yields a ``BalancedStep``.

``save_state`` / ``restore_state`` resume exactly: Energon's loader state (``save_state_rank``), the online ISF's
state, and the restore keys of the samples waiting in the buffer (they have left the loader already; on restore
``SavableDataLoader.restore_sample`` fetches them again).  Energon itself requires the same data-parallel size and
worker count on restore; ``restore_state`` refuses other ones by name.

Every sample is served once per epoch of the loader (the loader's epoch: a dataset read without ``repeat``, or an
epochized blend); a weighted blend samples by weight, as Energon defines it.  With ``repeat=False`` the iteration
ends when every rank's stream has ended and every buffer is empty; at that tail a step can hold fewer groups.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from omnibal_ext.data.online_isf import OnlineISF, OnlineISFConfig, SampleCost
from omnibal_ext.errors import UserError

from .look_ahead import LookAhead, balanced_step
from .task_encoder import CostedSample, sample_where

STATE_FORMAT = "omnibal-online-isf-loader"


@dataclass(frozen=True)
class BalancedStep:
    """One step of one rank: ``groups`` (one per micro-batch: ``collate`` of the post-encoded samples), with the
    samples' ``keys`` and ``costs`` in the same order."""

    groups: list[Any]
    keys: list[list[str]]
    costs: list[list[SampleCost]]


def all_gather_exchange(group=None) -> Callable[[np.ndarray], np.ndarray]:
    """The ``Exchange`` of ``OnlineISF`` over a ``torch.distributed`` group (CPU float64 tensors: gloo, or any
    backend that gathers CPU tensors); the identity matrix of one row without a process group."""

    def exchange(vector: np.ndarray) -> np.ndarray:
        if not dist.is_available() or not dist.is_initialized():
            return np.asarray(vector, dtype=np.float64)[None]
        mine = torch.as_tensor(np.asarray(vector, dtype=np.float64))
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        return torch.stack(rows).numpy()

    return exchange


class OnlineISFLoader:
    """The balancer of one DP rank (module docstring).

    loader: Energon's ``SavableDataLoader`` of this rank (dataset built with the mix-in task encoder,
    ``batch_size=None``); task_encoder: that task encoder (its ``postencode_sample`` decodes a selected sample);
    config: the online ISF's (``ranks`` = the DP size); group: the DP process group (None: the default group, or
    no exchange without ``torch.distributed``); collate: a group's post-encoded samples -> the micro-batch
    (default: the list); decode_threads: threads post-encoding a step's samples (0: in this thread).
    """

    def __init__(self, loader, task_encoder, config: OnlineISFConfig, group=None,
                 collate: Callable[[list[Any]], Any] | None = None, decode_threads: int = 0):
        self.loader = loader
        self.task_encoder = task_encoder
        self.isf = OnlineISF(config)
        self.group = group
        self.collate = collate or list
        self._exchange = all_gather_exchange(group)
        self._pool = ThreadPoolExecutor(decode_threads) if decode_threads > 0 else None
        self._buffer = LookAhead()
        self._iterator: Iterator | None = None
        self._ended = False

    # -- iteration ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[BalancedStep]:
        while True:
            step = self.next_step()
            if step is None:
                return
            yield step

    def next_step(self) -> BalancedStep | None:
        """This rank's next step; None once every rank's stream has ended and every buffer is empty.  Every rank
        must call it the same number of times (it all-gathers)."""
        if self.isf.done:
            return None
        self._fill()
        chosen = balanced_step(self.isf, self._buffer, self._exchange, self._ended, sample_where)
        if self.isf.done and not chosen:
            return None
        encoded = self._postencode([s for g in chosen for s in g])
        groups, k = [], 0
        for g in chosen:
            groups.append(self.collate(encoded[k:k + len(g)]))
            k += len(g)
        return BalancedStep(groups, [[s.__key__ for s in g] for g in chosen], [[s.cost for s in g] for g in chosen])

    def _fill(self) -> None:
        """Reads the loader until the buffer holds ``buffer_size`` samples or the loader's epoch has ended."""
        new: list[CostedSample] = []
        while not self._ended and len(self._buffer) + len(new) < self.isf.config.buffer_size:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            try:
                sample = next(self._iterator)
            except StopIteration:
                self._ended = True
                break
            if not isinstance(sample, CostedSample):
                raise UserError(f"online ISF loader: the loader yields {type(sample).__name__}, not CostedSample: "
                                f"build its dataset with a task encoder that mixes in OnlineISFTaskEncoderMixin "
                                f"and batch_size=None")
            new.append(sample)
        self._buffer.append(new)

    def _postencode(self, samples: list[CostedSample]) -> list[Any]:
        encode = self.task_encoder.postencode_sample
        if self._pool is None or len(samples) < 2:
            return [encode(s.sample) for s in samples]
        return list(self._pool.map(encode, [s.sample for s in samples]))

    # -- state ----------------------------------------------------------------------------------------------------
    def save_state(self) -> dict:
        """This rank's state between two steps: Energon's loader state, the online ISF's (JSON-able) and the restore
        keys of the buffered samples, oldest first (picklable, for ``torch.save``)."""
        return {"format": STATE_FORMAT, "loader": self.loader.save_state_rank(), "isf": self.isf.state_dict(),
                "buffer": self._buffer.restore_keys(), "ended": self._ended,
                "ranks": self.isf.config.ranks, "num_workers": self.loader.worker_config.num_workers}

    def restore_state(self, state: dict) -> None:
        """Restore ``save_state``'s state into this fresh balancer (before its first step): the same data-parallel
        size and loader worker count are required (Energon's own condition), else refused by name."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise UserError(f"online ISF loader state: not a {STATE_FORMAT} state")
        if self._iterator is not None or self._buffer:
            raise RuntimeError("online ISF loader: restore_state before the first step")
        workers = self.loader.worker_config.num_workers
        for name, saved, now in (("data-parallel size", state["ranks"], self.isf.config.ranks),
                                 ("loader worker count (num_workers)", state["num_workers"], workers)):
            if saved != now:
                raise UserError(f"online ISF loader state: saved at {name} {saved}, this run has {now}; Energon "
                                f"resumes only at the same one")
        self.loader.restore_state_rank(state["loader"])
        self.isf.load_state_dict(state["isf"])
        self._buffer = LookAhead.restored(self.loader, state["buffer"])
        self._ended = bool(state["ended"])

    @property
    def stream_ended(self) -> bool:
        """This rank's loader has ended its epoch (the buffer drains from now on)."""
        return self._ended

    @property
    def buffered(self) -> int:
        """Samples waiting in the buffer."""
        return len(self._buffer)

    @property
    def buffer_bytes(self) -> int:
        """Bytes the buffered samples hold in encoded media (the files' bytes: what the buffer costs in memory)."""
        total = 0
        for s in self._buffer.samples:
            inner = s.sample
            fields = inner.values() if isinstance(inner, dict) else (
                getattr(inner, name, None) for name in getattr(inner, "__dataclass_fields__", {}))
            total += sum(len(v) for v in fields if isinstance(v, (bytes, bytearray)))
        return total
