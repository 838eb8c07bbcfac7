"""Distributed sampler over groups: each global step gives one group to every data-parallel rank.

The groups are served as an endless stream of epochs.  Epoch ``e`` is a permutation of all ``G``
groups, built with ``numpy.random.default_rng(seed + e)``; global step ``s`` takes stream positions
``s*W .. s*W+W-1`` (``W = dp_size * sp`` groups per step, one per consumer).  So every group is
served exactly once per epoch for any DP size, and when ``G`` is not a multiple of ``W`` the last,
incomplete step of an epoch is completed with groups of the next epoch (carried, never dropped).

Random batching (``order=None``): every epoch deals the groups to steps at random.
Balanced batching (``order`` = the balanced group order from ``assign.assemble_steps``): the epoch
is [head] + shuffled full steps + [tail], where a full step is ``W`` consecutive groups of the order
(alike in tokens and tiles) and the head/tail (the groups that share a step with the neighbouring
epoch) are taken next to each other from the middle of the order, so that carried step is balanced
too.  Step order is shuffled every epoch; inside a step the runs of ``sp`` groups are dealt to the
DP ranks in a shuffled order.

Resuming: the position is just the global step count; ``state_dict()`` after taking ``k`` batches
and ``load_state_dict()`` on a fresh sampler yields batch ``k`` next, identical on every rank.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from .assign import PackPlan, StepAssembly
from .isf import Grouping


def random_groups(num_samples: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """Baseline "random batching": a seeded permutation of the samples cut into groups of ``k``
    (the last group holds the remainder; no sample dropped)."""
    if k < 1:
        raise ValueError(f"random_groups: k must be >= 1, got {k}")
    perm = np.random.default_rng(seed).permutation(num_samples).astype(np.int64)
    return [perm[i:i + k] for i in range(0, num_samples, k)]


def epoch_stream(num_groups: int, width: int, epoch: int, seed: int, order: np.ndarray | None = None,
                 sp: int = 1) -> np.ndarray:
    """Group ids of epoch ``epoch`` in serving order: a permutation of ``range(num_groups)``.

    The ``tail`` groups of epoch e-1 and the ``head`` groups of epoch e share one step; both are cut
    next to each other from the middle of a fixed base order (the balanced order, or in random mode
    a permutation seeded by ``seed``), so that step holds no group twice (when num_groups >= width)
    and, with a balanced order, is balanced too.
    """
    G, W = num_groups, width
    if W % sp:
        raise ValueError(f"epoch_stream: width {W} is not a multiple of sp={sp}")
    rng = np.random.default_rng(seed + epoch)
    base = np.random.default_rng(seed).permutation(G) if order is None else np.asarray(order)
    base = base.astype(np.int64)
    if G < W:  # an epoch is smaller than a step: a step necessarily repeats groups
        return base[rng.permutation(G)]
    head = (-epoch * G) % W  # groups of this epoch that complete the step the previous one began
    tail = ((epoch + 1) * G) % W  # groups of this epoch in a step the next one completes
    m = min(max(G // 2, tail), G - head)
    tail_ids, head_ids = base[m - tail:m], base[m:m + head]
    rest = np.concatenate([base[:m - tail], base[m + head:]])
    if order is None:  # random batching: new step compositions every epoch
        rest = rest[rng.permutation(len(rest))]
    else:  # balanced steps keep their composition; their order and the rank of each run change
        steps = rest.reshape(-1, W // sp, sp)
        rest = _shuffle_runs(steps[rng.permutation(len(steps))], rng).reshape(-1)
    return np.concatenate([head_ids, rest, tail_ids])


def _shuffle_runs(steps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Shuffle the runs (axis 1) inside each step of a (steps, runs, sp) array."""
    if steps.shape[0] == 0:
        return steps
    perm = rng.permuted(np.broadcast_to(np.arange(steps.shape[1]), steps.shape[:2]), axis=1)
    return steps[np.arange(steps.shape[0])[:, None], perm]


class GroupBatchSampler:
    """Yields, per global step, this consumer's group as a list of sample indices.

    groups: sample indices per group (list of arrays), a ``Grouping`` or a ``PackPlan`` (whose
    balanced order is then used unless ``order`` is given).
    dp_size, dp_rank: data-parallel ranks and this one; sp, sp_rank: sequence-parallel packs per
    rank and this one (a step has dp_size*sp groups; consumer dp_rank*sp + sp_rank).
    order: None for random step composition, or the balanced order (array or StepAssembly).
    num_steps: None = endless (epoch after epoch); otherwise iteration stops at that global step.
    """

    def __init__(
        self,
        groups: Sequence[np.ndarray] | Grouping | PackPlan,
        dp_size: int,
        dp_rank: int,
        seed: int = 0,
        order: np.ndarray | StepAssembly | None = None,
        num_steps: int | None = None,
        sp: int = 1,
        sp_rank: int = 0,
    ) -> None:
        if isinstance(groups, PackPlan):
            if order is None:
                order = groups.order
            groups = groups.groups
        elif isinstance(groups, Grouping):
            groups = groups.groups()
        if isinstance(order, StepAssembly):
            order = order.order
        self.groups = [np.asarray(g, dtype=np.int64) for g in groups]
        G = len(self.groups)
        if G == 0:
            raise ValueError("GroupBatchSampler: no groups to serve")
        if dp_size < 1 or not (0 <= dp_rank < dp_size):
            raise ValueError(f"GroupBatchSampler: need 0 <= dp_rank < dp_size, got {dp_rank}, {dp_size}")
        if sp < 1 or not (0 <= sp_rank < sp):
            raise ValueError(f"GroupBatchSampler: need 0 <= sp_rank < sp, got {sp_rank}, {sp}")
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            if not np.array_equal(np.sort(order), np.arange(G)):
                raise ValueError(f"GroupBatchSampler: order is not a permutation of the {G} groups")
        self.order = order
        self.dp_size, self.dp_rank, self.sp, self.sp_rank = dp_size, dp_rank, sp, sp_rank
        self.width = dp_size * sp
        self.consumer = dp_rank * sp + sp_rank
        self.seed = int(seed)
        self.num_steps = num_steps
        self.step = 0
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def steps_per_epoch(self) -> float:
        """Global steps per epoch (fractional when the group count is not a multiple of the width)."""
        return self.num_groups / self.width

    def __len__(self) -> int:
        if self.num_steps is not None:
            return max(0, self.num_steps - self.step)
        return -(-self.num_groups // self.width)

    def _epoch(self, epoch: int) -> np.ndarray:
        s = self._cache.get(epoch)
        if s is None:
            s = epoch_stream(self.num_groups, self.width, epoch, self.seed, self.order, self.sp)
            self._cache[epoch] = s
            while len(self._cache) > 4:
                self._cache.popitem(last=False)
        return s

    def step_groups(self, step: int) -> np.ndarray:
        """Group ids of global step ``step`` for all consumers (length dp_size*sp)."""
        pos = step * self.width + np.arange(self.width)
        epochs, idx = np.divmod(pos, self.num_groups)
        out = np.empty(self.width, dtype=np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self._epoch(e)[idx[sel]]
        return out

    def __iter__(self):
        while self.num_steps is None or self.step < self.num_steps:
            gid = self.step_groups(self.step)[self.consumer]
            self.step += 1
            yield self.groups[gid].tolist()

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "num_groups": self.num_groups, "width": self.width}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("num_groups", self.num_groups), ("width", self.width), ("seed", self.seed)):
            if key in state and int(state[key]) != mine:
                raise ValueError(
                    f"GroupBatchSampler.load_state_dict: saved {key}={state[key]} but this sampler has {mine}")
        self.step = int(state["step"])
