"""Distributed sampler over groups: each global step gives one group to every data-parallel rank.

The stream.  Groups are served as one stream of group ids, read ``W = dp_size * sp`` at a time:
global step ``s`` takes stream *positions* ``s*W .. s*W+W-1`` (one per consumer, consumer
``dp_rank*sp + sp_rank`` takes ``s*W + consumer``), and an iteration of ``M`` micro-batches takes
``B = W * M`` consecutive positions, the *iteration block*.  A position is thus a count of groups
served since the start of the stream (the checkpoint records it: ``state_dict()["position"]``).

The stream is a sequence of epochs.  Epoch ``e`` is a permutation of all ``G`` groups, built with
``numpy.random.default_rng(seed + e)``, so every group is served exactly once per epoch, nothing
dropped: when ``G`` is not a multiple of ``B`` the last, incomplete iteration block of an epoch is
completed with groups of the next epoch (carried).  The ``tail`` groups of epoch e and the ``head``
groups of epoch e+1 that share that block are cut next to each other from the middle of a fixed
base order, so the block holds no group twice (when ``G >= B``).

Random batching (``order=None``): the epoch's groups outside head and tail are shuffled.  The stream
then depends on ``G``, the seed and ``B`` only, not on ``W``: with the same global and micro-batch
sizes (so the same groups per iteration ``B = dp * micro-batches``), iteration i serves the same set
of groups for any DP size; DP only decides which rank trains which of them.
Balanced batching (``order`` = the balanced group order from ``assign.assemble_steps``): the epoch is
[head] + shuffled full steps + [tail], where a full step is ``W`` consecutive groups of the order
(alike in tokens and tiles: ISF's balance across DP ranks); head and tail, taken next to each other
from the middle of the order, are balanced too.  Step order is shuffled every epoch; inside a step
the runs of ``sp`` groups are dealt to the DP ranks in a shuffled order.  Head and tail are counted
in iteration blocks, so full steps start at step boundaries.

Rest of an epoch (prefix).  A sampler may serve, before its regular epochs, a *prefix*: the samples
of one epoch that a previous run had not yet served, regrouped by this run's method.  The prefix is
served like an epoch of its own groups (numbered ``first_epoch - 1``), then regular epochs
``first_epoch, first_epoch + 1, ...`` follow, carried across the prefix's end as between epochs.

Resuming.  ``state_dict()`` (identical on every rank) holds the position, a fingerprint of the
regular stream (groups, order, seed, B; W and sp too in balanced mode), the prefix, the current
epoch and the sample ids of that epoch not served yet.  ``load_state_dict()`` on a fresh sampler:

* same fingerprint: continue at the same position, bit-exactly (any DP size in random mode; the
  position must fall on a step of this run, and on an iteration boundary when W changed);
* otherwise (a DP change under ISF, whose groups and order depend on DP; or other groups, seed or
  groups per iteration): the rest of the epoch is regrouped for this run by ``regroup(sample_ids)
  -> (groups, order)`` and served first, then this run's regular epochs follow from the next epoch
  number.  No sample of the interrupted epoch is repeated or lost.  The one iteration block that
  joins the regrouped rest and the next epoch may hold a sample twice (once for each epoch).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from ..errors import UserError
from .assign import PackPlan, StepAssembly
from .isf import Grouping

STATE_VERSION = 2

# regroup(sample ids) -> (groups of sample ids, balanced order or None)
Regroup = Callable[[np.ndarray], "tuple[list[np.ndarray], np.ndarray | None]"]


def random_groups(num_samples: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """Baseline "random batching": a seeded permutation of the samples cut into groups of ``k``
    (the last group holds the remainder; no sample dropped)."""
    if k < 1:
        raise ValueError(f"random_groups: k must be >= 1, got {k}")
    perm = np.random.default_rng(seed).permutation(num_samples).astype(np.int64)
    return [perm[i:i + k] for i in range(0, num_samples, k)]


def random_regroup(k: int, seed: int = 0) -> Regroup:
    """The ``regroup`` of random batching: given sample ids, random groups of ``k`` of them, no order."""
    def regroup(sample_ids: np.ndarray) -> tuple[list[np.ndarray], None]:
        ids = np.asarray(sample_ids, dtype=np.int64)
        return [ids[g] for g in random_groups(len(ids), k, seed)], None
    return regroup


def epoch_stream(num_groups: int, width: int, epoch: int, seed: int, order: np.ndarray | None = None,
                 sp: int = 1, block: int | None = None, start: int | None = None) -> np.ndarray:
    """Group ids of epoch ``epoch`` in serving order: a permutation of ``range(num_groups)``.

    width: groups per step W; block: groups per iteration B (a multiple of W; default W), the unit
    head and tail are counted in; start: stream position (groups) of the epoch's first group
    (default ``epoch * num_groups``; only ``start % block`` matters).  The ``head`` groups complete
    the block the previous epoch began, the ``tail`` groups begin a block the next one completes;
    both are cut next to each other from the middle of a fixed base order (the balanced order, or in
    random mode a permutation seeded by ``seed``), so that block holds no group twice (when
    num_groups >= block) and, with a balanced order, is balanced too.  In random mode the result
    does not depend on ``width``.
    """
    G, W = num_groups, width
    B = W if block is None else int(block)
    if W % sp:
        raise ValueError(f"epoch_stream: width {W} is not a multiple of sp={sp}")
    if B < W or B % W:
        raise ValueError(f"epoch_stream: block {B} is not a positive multiple of width {W}")
    start = epoch * G if start is None else int(start)
    rng = np.random.default_rng(seed + epoch)
    base = np.random.default_rng(seed).permutation(G) if order is None else np.asarray(order)
    base = base.astype(np.int64)
    # balanced steps stay whole with a step-sized unit when an epoch is smaller than a block
    unit = B if (G >= B or order is None) else W
    if G < unit:  # an epoch is smaller than the unit: a block necessarily repeats groups
        return base[rng.permutation(G)]
    head = (-start) % unit  # groups of this epoch that complete the block the previous one began
    tail = (start + G) % unit  # groups of this epoch in a block the next one completes
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


def _compact_ids(ids: np.ndarray) -> np.ndarray:
    """Sample ids as int32 when they fit (checkpoint size), else int64."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids.astype(np.int32) if ids.size == 0 or ids.max() < 2**31 else ids


def _split_groups(members: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """Groups of sample ids from CSR form (members group after group, sizes per group)."""
    members = np.asarray(members, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.split(members, np.cumsum(sizes)[:-1]) if len(sizes) else []


def _checked_order(order, num_groups: int, who: str) -> np.ndarray | None:
    """``order`` as an int64 permutation of ``range(num_groups)``, or None."""
    if order is None:
        return None
    order = np.asarray(order, dtype=np.int64)
    if not np.array_equal(np.sort(order), np.arange(num_groups)):
        raise ValueError(f"{who}: order is not a permutation of the {num_groups} groups")
    return order


def stream_fingerprint(groups: Sequence[np.ndarray], order: np.ndarray | None, seed: int, block: int,
                       width: int, sp: int) -> str:
    """Hex digest of what decides the regular stream: groups, order, seed, groups per iteration,
    and (balanced mode only) groups per step and sp."""
    h = hashlib.sha256()
    sizes = np.fromiter((len(g) for g in groups), np.int64, len(groups))
    h.update(sizes.tobytes())
    h.update(np.concatenate(list(groups)).astype(np.int64).tobytes() if len(groups) else b"")
    h.update(b"random" if order is None else b"balanced" + np.asarray(order, np.int64).tobytes())
    shape = (seed, block) if order is None else (seed, block, width, sp)
    h.update(repr(shape).encode())
    return h.hexdigest()


class GroupBatchSampler:
    """Yields, per global step, this consumer's group as a list of sample indices.

    groups: sample indices per group (list of arrays), a ``Grouping`` or a ``PackPlan`` (whose
    balanced order is then used unless ``order`` is given).
    dp_size, dp_rank: data-parallel ranks and this one; sp, sp_rank: sequence-parallel packs per
    rank and this one (a step has dp_size*sp groups; consumer dp_rank*sp + sp_rank).
    order: None for random step composition, or the balanced order (array or StepAssembly).
    num_steps: None = endless (epoch after epoch); otherwise iteration stops at that global step.
    microbatches: steps per iteration M (the iteration block is dp_size*sp*M groups).
    regroup: ``regroup(sample_ids) -> (groups, order)``, how this run groups a subset of samples
    (called by ``load_state_dict`` when the saved stream differs from this one; collective in the
    trainer, so every rank must load).  None: such a state is refused.
    take: groups per consumer per step, served together as one micro-batch (random batching only): with
    single-sample groups and ``take`` = the micro-batch size, an iteration's samples are a slice of the
    stream of ``dp_size * take * microbatches`` = global batch samples that does not depend on the
    micro-batch size (micro-batches are slices of the global batch, as in Megatron).
    After ``load_state_dict``, ``resumed`` says how: "continued" (same stream), "regrouped" (the rest of
    the saved epoch regrouped and served first) or "next epoch" (nothing of the saved epoch served).
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
        microbatches: int = 1,
        regroup: Regroup | None = None,
        take: int = 1,
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
        if microbatches < 1:
            raise ValueError(f"GroupBatchSampler: microbatches must be >= 1, got {microbatches}")
        self.order = _checked_order(order, G, "GroupBatchSampler")
        if take < 1 or (take > 1 and (order is not None or sp > 1)):
            raise ValueError(f"GroupBatchSampler: take={take} needs random batching without sp, and >= 1")
        self.dp_size, self.dp_rank, self.sp, self.sp_rank = dp_size, dp_rank, sp, sp_rank
        self.take = int(take)
        self.width = dp_size * sp * self.take
        self.block = self.width * microbatches
        self.consumer = (dp_rank * sp + sp_rank) * self.take
        self.resumed: str | None = None
        self.seed = int(seed)
        self.num_steps = num_steps
        self.regroup = regroup
        self.step = 0
        self._fingerprint: str | None = None
        self._set_prefix([], None, first_epoch=0)

    # ------------------------------------------------------------------ the stream
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def fingerprint(self) -> str:
        """Digest of the regular stream (see ``stream_fingerprint``); computed once."""
        if self._fingerprint is None:
            self._fingerprint = stream_fingerprint(self.groups, self.order, self.seed, self.block,
                                                   self.width, self.sp)
        return self._fingerprint

    @property
    def steps_per_epoch(self) -> float:
        """Global steps per epoch (fractional when the group count is not a multiple of the width)."""
        return self.num_groups / self.width

    @property
    def position(self) -> int:
        """Groups of the stream served so far (all consumers): step * width."""
        return self.step * self.width

    def __len__(self) -> int:
        if self.num_steps is not None:
            return max(0, self.num_steps - self.step)
        return -(-self.num_groups // self.width)

    def _set_prefix(self, groups: list[np.ndarray], order: np.ndarray | None, first_epoch: int) -> None:
        """Serve ``groups`` (the rest of epoch first_epoch-1) before regular epoch ``first_epoch``."""
        self.prefix_groups = [np.asarray(g, dtype=np.int64) for g in groups]
        self.prefix_order = _checked_order(order, len(groups), "GroupBatchSampler prefix")
        self.first_epoch = int(first_epoch)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def _segment_at(self, pos: int) -> tuple[int, int]:
        """(segment, its first position) holding stream position ``pos``; segment -1 is the prefix,
        k >= 0 regular epoch first_epoch + k."""
        P = len(self.prefix_groups)
        if pos < P:
            return -1, 0
        k = (pos - P) // self.num_groups
        return k, P + k * self.num_groups

    def _segment_epoch(self, k: int) -> int:
        return self.first_epoch + k

    def _segment_stream(self, k: int) -> np.ndarray:
        """Group ids of segment ``k`` in serving order; prefix groups are numbered from num_groups."""
        s = self._cache.get(k)
        if s is None:
            if k < 0:
                s = self.num_groups + epoch_stream(len(self.prefix_groups), self.width, self.first_epoch - 1,
                                                   self.seed, self.prefix_order, self.sp, self.block, start=0)
            else:
                start = len(self.prefix_groups) + k * self.num_groups
                s = epoch_stream(self.num_groups, self.width, self._segment_epoch(k), self.seed, self.order,
                                 self.sp, self.block, start=start)
            self._cache[k] = s
            while len(self._cache) > 4:
                self._cache.popitem(last=False)
        return s

    def group(self, gid: int) -> np.ndarray:
        """Sample ids of group ``gid`` (ids >= num_groups are prefix groups)."""
        G = self.num_groups
        return self.groups[gid] if gid < G else self.prefix_groups[gid - G]

    def step_groups(self, step: int) -> np.ndarray:
        """Group ids of global step ``step`` for all consumers (length dp_size*sp); ids >= num_groups
        are prefix groups (see ``group``)."""
        out = np.empty(self.width, dtype=np.int64)
        for j, pos in enumerate(range(step * self.width, (step + 1) * self.width)):
            k, start = self._segment_at(pos)
            out[j] = self._segment_stream(k)[pos - start]
        return out

    def __iter__(self):
        while self.num_steps is None or self.step < self.num_steps:
            gids = self.step_groups(self.step)[self.consumer:self.consumer + self.take]
            self.step += 1
            yield [i for gid in gids for i in self.group(int(gid)).tolist()]

    def seek(self, step: int) -> None:
        """Continue at global step ``step`` of the current stream (evaluation rewinds with 0)."""
        self.step = int(step)

    # ------------------------------------------------------------------ checkpoint state
    def unserved_samples(self) -> tuple[int, np.ndarray, bool]:
        """(current epoch, its sample ids not served yet in serving order, whether any was served)."""
        pos = self.position
        k, start = self._segment_at(pos)
        rest = self._segment_stream(k)[pos - start:]
        ids = np.concatenate([self.group(int(g)) for g in rest])
        return self._segment_epoch(k), ids, bool(k < 0 or pos > start)

    def state_dict(self) -> dict:
        """Picklable, identical on every rank: position, stream fingerprint, prefix, rest of the epoch."""
        epoch, unserved, started = self.unserved_samples()
        sizes = np.fromiter((len(g) for g in self.prefix_groups), np.int64, len(self.prefix_groups))
        members = np.concatenate(self.prefix_groups) if self.prefix_groups else np.zeros(0, np.int64)
        return {
            "version": STATE_VERSION, "position": self.position, "fingerprint": self.fingerprint,
            "num_groups": self.num_groups, "seed": self.seed, "width": self.width, "block": self.block,
            "balanced": self.order is not None,
            "epoch": epoch, "epoch_started": started, "unserved": _compact_ids(unserved),
            "first_epoch": self.first_epoch, "prefix_members": _compact_ids(members),
            "prefix_sizes": sizes.astype(np.int32),
            "prefix_order": None if self.prefix_order is None else self.prefix_order.astype(np.int32),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` (from ``state_dict``, possibly of another configuration) left off."""
        if state.get("version") != STATE_VERSION:
            raise UserError(
                f"the checkpoint's data state has version {state.get('version')!r}, this trainer reads "
                f"version {STATE_VERSION} (position, stream fingerprint, rest of the epoch); it was written "
                f"by an older trainer: restart from a newer checkpoint or from scratch")
        if state["fingerprint"] == self.fingerprint:
            self._continue(state)
        else:
            self._regroup_rest(state)

    def _continue(self, state: dict) -> None:
        """Same regular stream: restore the prefix and the position."""
        pos, W = int(state["position"]), self.width
        if pos % W:
            raise UserError(
                f"the checkpoint's data position ({pos} groups into the stream) is not a multiple of this "
                f"run's {W} groups per global step (data-parallel size x sp); resume with a data-parallel "
                f"size that divides the position")
        if int(state["width"]) != W and pos % self.block:
            raise UserError(
                f"the checkpoint's data position ({pos} groups) is not on an iteration boundary of this run "
                f"({self.block} groups per iteration); a data-parallel change needs a checkpoint saved at the "
                f"end of an iteration with the same global and micro-batch sizes")
        groups = _split_groups(state["prefix_members"], state["prefix_sizes"])
        self._set_prefix(groups, state["prefix_order"], int(state["first_epoch"]))
        self.step = pos // W
        self.resumed = "continued"

    def _regroup_rest(self, state: dict) -> None:
        """Another regular stream: serve the rest of the saved epoch regrouped, then epochs from the next."""
        epoch, unserved = int(state["epoch"]), np.asarray(state["unserved"], dtype=np.int64)
        if self.regroup is None:
            raise UserError(
                f"the checkpoint's data stream differs from this run's (saved: {state['num_groups']} groups, "
                f"seed {state['seed']}, {state['width']} per step, {state['block']} per iteration, "
                f"balanced={state['balanced']}; now: {self.num_groups} groups, seed {self.seed}, "
                f"{self.width} per step, {self.block} per iteration, balanced={self.order is not None}) "
                f"and this sampler has no regroup function to serve the rest of the epoch")
        num_samples = sum(len(g) for g in self.groups)
        if unserved.size and (unserved.min() < 0 or unserved.max() >= num_samples):
            raise UserError(
                f"the checkpoint's data state lists sample {int(unserved.max())} still to serve, but this "
                f"run's training set holds {num_samples} samples: resume with the same training data")
        if not state["epoch_started"]:  # nothing of that epoch served: start it afresh
            self._set_prefix([], None, first_epoch=epoch)
            self.resumed = "next epoch"
        else:
            self.resumed = "regrouped"
            groups, order = self.regroup(unserved)
            _check_regrouped(groups, unserved)
            self._set_prefix(list(groups), order, first_epoch=epoch + 1)
        self.step = 0


def _check_regrouped(groups: Sequence[np.ndarray], sample_ids: np.ndarray) -> None:
    """Raise ValueError unless ``groups`` partition ``sample_ids`` (a bug in the regroup function)."""
    flat = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups]) if len(groups) else np.zeros(0, np.int64)
    if not np.array_equal(np.sort(flat), np.sort(sample_ids)):
        raise ValueError(f"regroup: the {len(groups)} groups do not partition the {len(sample_ids)} samples "
                         f"given (some missing or repeated)")
