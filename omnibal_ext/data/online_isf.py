"""ISF online: balanced groups from a bounded look-ahead buffer per data-parallel rank, in predicted time.

Offline ISF (``isf.py``) sees the whole dataset: it packs groups up to caps, keeps those that reach lower bounds
and sorts the groups so that the N groups of a step are alike.  A streaming loader (Energon's savable loader, one
per DP rank) sees only what it has read.  Here every rank keeps a look-ahead buffer of samples, each with its cost
from cheap metadata (``SampleCost``: ViT items and LLM tokens, the hard caps that memory is planned for; predicted
ViT and LLM seconds, what the step waits for), and every step each rank packs its own groups out of its own buffer
to a TARGET that all ranks share, so that every group of the step, on every rank, holds the same predicted ViT time
and the same predicted LLM time (within ``tolerance``).  No sample moves between ranks; the ranks exchange one small
float64 vector per step (``Exchange``: an all-gather of ``SUMMARY_FIELDS`` numbers).

One step on one rank (``OnlineISF.next_step_groups`` = ``propose``, the all-gather, ``settle``):

1. the TARGET ``(vit_s, llm_s)`` of a group is the one all ranks agreed at the end of the previous step (the first
   step: the configured one, else ``samples_per_group`` times the mean sample of this rank's buffer);
2. each of the ``groups_per_step`` groups starts from the OLDEST sample in the buffer (its anchor) and is filled
   toward the target, each time apart (``fill_group``): while more than about three mean samples are missing, the
   sample that leaves the most typical remainder; then the single sample, else the pair (``complete_pair``: a
   sorted-bucket search over all pairs in O(n log n)), that completes the group within ``tolerance``
   (``4 tolerance`` for a pair); a group that misses is ``repair``-ed (one sample exchanged for one or two) and
   tried again with another first pick and a look-ahead (``fill_best``, ``_look_ahead``: one sample then a pair,
   where greedy picks dead-end on a lattice of tile times), then from the next oldest anchors (``ANCHOR_TRIES``).  A
   sample that missed as an anchor is not tried as one for ``ANCHOR_COOLDOWN`` steps (it may still fill others'
   groups); one that has waited ``max_wait_steps`` starts the next group whatever.  A rank whose buffer's mix is
   off the target's (``is_skewed``: a skewed shard) and cannot reach it packs to the total time instead
   (``Frame``), as close to the mix as its samples come;
3. the rank all-gathers its summary (``StepSummary``: its groups' lowest and total times, its buffer, what it has
   seen, whether its stream has ended); every rank computes the same COMMON LEVEL of each time
   (``common_level``: the level that leaves the least idle time, a rank far below the others, such as one whose
   stream is draining, pulling the step down to it) and repacks its groups more than ``2 tolerance`` above it
   toward it;
4. the next target is the median rank's mean group, pulled ``TARGET_PULL`` of the way toward the NOMINAL target
   (the configured total, else ``samples_per_group`` times the mean sample all ranks have seen, split between ViT
   and LLM at the mix of all the samples buffered, so that uncommon samples do not pile up), and every
   ``PROBE_EVERY`` steps the nominal target itself: times in tiles are a lattice (a group's ViT time is a
   multiple of one tile's), and following the groups' own median keeps the target on the lattice point they
   reach.

The count caps (ViT items, LLM tokens) are hard: no group exceeds them.  They are configured (``max_vit_items``,
``max_tokens``, e.g. from a stats file: ``OnlineISFConfig.from_isf_params``), or set at the first step from what
all ranks have seen (``count_caps_from_stats``: twice / two and a half the target group's mean tokens / items,
never below the largest sample seen), then fixed.  A sample over a count cap raises ``OnlineOversizeError`` naming
its buffer position (the caller names its key), or, with ``oversize="solo"``, is served as a group of its own.

Context parallelism (``cp``): the CP ranks of one DP rank share its groups.  The LLM tokens are split evenly by the
trainer (each segment padded to a multiple of 2 x CP: the caller counts the padded tokens and their time in
``SampleCost``, ``cp_split.cp_multiple``); the ViT work goes in whole images, in contiguous runs balanced by
predicted time (``cp_split.image_runs``).  Under CP a group is packed as ``cp`` consecutive parts, each toward a
``cp``-th of the target in both times and within a ``cp``-th of the ViT items cap (``_compose``), so that the
trainer's contiguous split finds runs as even as the parts: the group waits for its slowest CP rank, and that is
what the ranks match (the benchmark's CP row, ``scripts/bench_online_isf.py``).  The nominal target and the
derived caps are then of ``samples_per_group`` samples per CP rank.

Nothing is dropped or duplicated: every returned position is a sample of the buffer, each at most once in a step;
what is not returned stays for later steps; ``final=True`` (the stream ended) keeps serving until the buffer is
empty.  Everything is deterministic given the same buffers and exchanges, and ``state_dict`` / ``load_state_dict``
(JSON-able) resume it exactly (the caller restores the buffer itself, in the same order).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Sequence

import numpy as np

from ..errors import UserError

Exchange = Callable[[np.ndarray], np.ndarray]
"""This rank's small float64 vector -> the [ranks, n] matrix of every rank's vector (an all-gather)."""

TARGET_PULL = 0.02  # share of the way from the step's mean group to the nominal target taken each step
PROBE_EVERY = 16  # every so many steps the target is the nominal one (module docstring, step 4)
MISSING_FOR_PAIR = 3.5  # a group this many mean samples short or less is completed by one sample or a pair
MISSING_FOR_TRIPLE = 5.0  # one this short or less, where no pair completes it, tries a sample then a pair (look-ahead)
LOOKAHEAD = 8  # first samples the look-ahead tries, the best of each p bucket (distinct ViT sizes on a lattice)
EXACT_MAX = 12  # a group with at most this many candidates left is completed by an exhaustive subset search
LEVEL_FLOOR = 0.9  # a rank whose stream goes on pulls the common level down to this share of the target at most
SKEW_MIN_SAMPLES = 32  # a buffer this small is not judged skewed (its mean mix is mostly chance)
MIX_SKEW = 0.1  # a buffer whose mean mix (x - y) is off by this share of its mean total packs in total when (x, y) miss
ANCHOR_COOLDOWN = 32  # a sample that missed as a group's start is not tried as one again for so many steps
NEVER = -(1 << 40)  # the step of a miss that never happened
ANCHOR_TRIES = 4  # a group whose oldest sample misses the target tries this many oldest samples in all
GOOD_ENOUGH = 2.0  # a group within this many tolerances of its target takes no repair and no further tries
RETRIES = 1  # more tries of a group that missed its target, each with another first pick
OVERSIZE_POLICIES = ("error", "solo")


@dataclass(frozen=True)
class SampleCost:
    """One sample's cost, from cheap metadata (no pixels decoded).

    vit_items: ViT items (tiles or patches: the family's unit) the sample feeds the ViT; tokens: its LLM tokens,
    image tokens expanded (under CP: padded as the trainer pads them); vit_s: predicted ViT-side seconds (forward +
    backward); llm_s: predicted LLM-side seconds.
    """

    vit_items: int
    tokens: int
    vit_s: float
    llm_s: float


class OnlineOversizeError(UserError):
    """A sample over a count cap under ``oversize="error"``; ``position`` is its place in the buffer."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


@dataclass(frozen=True)
class OnlineISFConfig:
    """What the online ISF aims at.

    ranks: data-parallel ranks that exchange summaries (the ``Exchange`` returns one row per rank);
    groups_per_step: groups (micro-batches) each rank serves per step;
    buffer_size: look-ahead samples per rank (the caller keeps the buffer this full while its stream lasts);
    max_vit_items / max_tokens: hard count caps of a group (None: set at the first step from what was seen);
    vit_time_s / llm_time_s: nominal target of a group's predicted ViT / LLM seconds (None: ``samples_per_group``
    times the mean sample seen);
    samples_per_group: K, the mean samples per group (per CP rank under CP) the derived targets and caps aim at;
    tolerance: relative distance of a group's times from the target that counts as reached (the step's spread is
    at most twice it);
    cp: context-parallel ranks sharing each group (packed in ``cp`` even parts, module docstring);
    oversize: a sample over a count cap raises (``"error"``) or forms a group of its own (``"solo"``);
    max_wait_steps: steps the oldest sample may be passed over (its group missing the target) before a group must
    start from it (None: ``buffer_size // groups_per_step``).
    """

    ranks: int
    groups_per_step: int = 1
    buffer_size: int = 1024
    max_vit_items: int | None = None
    max_tokens: int | None = None
    vit_time_s: float | None = None
    llm_time_s: float | None = None
    samples_per_group: float = 4.0
    tolerance: float = 0.0025
    cp: int = 1
    oversize: str = "error"
    max_wait_steps: int | None = None

    def __post_init__(self) -> None:
        for name in ("ranks", "groups_per_step", "buffer_size", "cp"):
            if getattr(self, name) < 1:
                raise UserError(f"OnlineISFConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.buffer_size < self.groups_per_step:
            raise UserError(f"OnlineISFConfig: buffer_size ({self.buffer_size}) must hold at least one sample per "
                            f"group ({self.groups_per_step} groups per step)")
        for name in ("max_vit_items", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0 or (name == "max_tokens" and value == 0):
                raise UserError(f"OnlineISFConfig: {name} must be positive, got {value}")
        for name in ("vit_time_s", "llm_time_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"OnlineISFConfig: {name} must be > 0 seconds, got {value}")
        if not self.samples_per_group > 0:
            raise UserError(f"OnlineISFConfig: samples_per_group must be > 0, got {self.samples_per_group}")
        if not 0 < self.tolerance < 0.1:
            raise UserError(f"OnlineISFConfig: tolerance must be in (0, 0.1), got {self.tolerance}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise UserError(f"OnlineISFConfig: oversize must be one of {OVERSIZE_POLICIES}, got {self.oversize!r}")

    @classmethod
    def from_isf_params(cls, params, time_unit_s: float, **kwargs) -> "OnlineISFConfig":
        """A config with the caps of offline ISF thresholds (``isf.ISFParams``, e.g. ``omnibal isf search --model``
        on a stats file): its count caps as the hard caps and, for params in time, its time caps (integer units of
        ``time_unit_s`` seconds, ``sample_time.TIME_UNIT_S``) as the nominal target; ``kwargs``: the other fields."""
        extra = {}
        if params.timed:
            extra = {"vit_time_s": params.vit_time * time_unit_s, "llm_time_s": params.llm_time * time_unit_s}
        return cls(max_vit_items=int(params.qv), max_tokens=int(params.qt), **extra, **kwargs)


@dataclass(frozen=True)
class BufferCosts:
    """Costs of a buffer as arrays (one entry per sample, oldest first): what the packer reads.

    vit_items, tokens: int64 (n,); vit_s, llm_s: float64 (n,) seconds.
    """

    vit_items: np.ndarray
    tokens: np.ndarray
    vit_s: np.ndarray
    llm_s: np.ndarray

    @classmethod
    def from_costs(cls, costs: Sequence[SampleCost]) -> "BufferCosts":
        n = len(costs)
        return cls(np.fromiter((c.vit_items for c in costs), np.int64, n),
                   np.fromiter((c.tokens for c in costs), np.int64, n),
                   np.fromiter((c.vit_s for c in costs), np.float64, n),
                   np.fromiter((c.llm_s for c in costs), np.float64, n))

    @classmethod
    def of(cls, buffer) -> "BufferCosts":
        """``buffer`` itself when it is a table, else the table of a sequence of ``SampleCost``."""
        return buffer if isinstance(buffer, BufferCosts) else cls.from_costs(buffer)

    def __len__(self) -> int:
        return len(self.vit_s)

    def take(self, positions: np.ndarray) -> "BufferCosts":
        return BufferCosts(self.vit_items[positions], self.tokens[positions], self.vit_s[positions],
                         self.llm_s[positions])

    def concat(self, other: "BufferCosts") -> "BufferCosts":
        return BufferCosts(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self)))


@dataclass(frozen=True)
class Level:
    """A group's (or a target's) predicted ViT and LLM seconds."""

    vit_s: float
    llm_s: float


@dataclass(frozen=True)
class Caps:
    """The hard count caps of a group: ViT items and LLM tokens."""

    vit_items: int
    tokens: int


@dataclass(frozen=True)
class StepSummary:
    """What one rank tells the others each step (one row of the all-gather; ``SUMMARY_FIELDS`` numbers).

    serving: 1 while the rank has samples to serve (its groups count for the common level), else 0;
    min_vit_s / min_llm_s: its lowest group times this step (inf without groups); sum_vit_s / sum_llm_s / groups:
    its groups' total times and count; buffered: samples in its buffer this step (served ones included);
    buffer_vit_s / buffer_llm_s: their ViT and LLM seconds; ended: 1 once its stream has ended;
    skewed: 1 when its buffer's mix is off the target's (``is_skewed``);
    seen, seen_vit_s, seen_llm_s, seen_vit_items, seen_tokens: how many samples it has seen in all and their sums;
    max_vit_items / max_tokens: its largest sample seen.
    """

    serving: float
    min_vit_s: float
    min_llm_s: float
    sum_vit_s: float
    sum_llm_s: float
    groups: float
    buffered: float
    buffer_vit_s: float
    buffer_llm_s: float
    ended: float
    skewed: float
    seen: float
    seen_vit_s: float
    seen_llm_s: float
    seen_vit_items: float
    seen_tokens: float
    max_vit_items: float
    max_tokens: float

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)


SUMMARY_FIELDS = len(fields(StepSummary))
_COLUMN = {f.name: k for k, f in enumerate(fields(StepSummary))}


@dataclass(frozen=True)
class Summaries:
    """Every rank's ``StepSummary`` from the all-gathered [ranks, SUMMARY_FIELDS] matrix, as columns:
    ``column(name)`` is the field ``name`` of every rank (float64 (ranks,))."""

    matrix: np.ndarray

    @classmethod
    def of(cls, gathered: np.ndarray, ranks: int) -> "Summaries":
        m = np.asarray(gathered, dtype=np.float64)
        if m.shape != (ranks, SUMMARY_FIELDS):
            raise ValueError(f"exchange: expected a [{ranks}, {SUMMARY_FIELDS}] matrix (ranks, summary fields), "
                             f"got shape {m.shape}")
        return cls(m)

    def column(self, name: str) -> np.ndarray:
        return self.matrix[:, _COLUMN[name]]




# ----------------------------------------------------------------------------------------------- packing
# A group is packed in coordinates of its samples normalized by the target.  First in each time apart ("dims": x,
# the share of the target's ViT time; y, of its LLM time; reached when both are within ``tol`` of 1); where that
# misses by more than ``4 tol`` (a rank whose samples cannot give the target's mix: a skewed shard), in total and
# mix ("total": u, the share of the target's ViT + LLM time; v = x - y, 0 for the target's own mix; reached when u
# is within ``tol`` of 1 and v within ``2 tol`` of 0): its groups then still match the others in total time and
# come as close to the mix as they can.


@dataclass(frozen=True)
class Frame:
    """Every buffered sample's coordinates ``p`` and ``q`` in one of the two frames above for ``target``, their
    means, and the frame's rules: ``total`` False for (x, y), True for (u, v)."""

    p: np.ndarray
    q: np.ndarray
    mean_p: float
    mean_q: float
    total: bool
    target: Level

    @classmethod
    def of(cls, table: BufferCosts, target: Level, total: bool) -> "Frame":
        x = table.vit_s / target.vit_s if target.vit_s > 0 else np.zeros(len(table))
        y = table.llm_s / target.llm_s
        if total:
            p, q = (table.vit_s + table.llm_s) / (target.vit_s + target.llm_s), x - y
        else:
            p, q = x, y
        return cls(p, q, float(p.mean()) if len(p) else 0.0, float(q.mean()) if len(q) else 0.0, total, target)

    def goal(self) -> tuple[float, float]:
        """The coordinates of a group that is exactly on target."""
        return (1.0, 0.0) if self.total else (1.0, 1.0)

    def errors(self, members: list[int]) -> tuple[float, float]:
        gp, gq = self.goal()
        return abs(gp - float(self.p[members].sum())), abs(gq - float(self.q[members].sum()))

    def reached(self, ep: float, eq: float, tol: float) -> bool:
        return ep <= tol and eq <= (2 * tol if self.total else tol)

    def score(self, ep, eq, tol: float):
        """Order of completions by their errors (lower is better): the larger error in (x, y); the total first,
        then the mix, in (u, v)."""
        if self.total:
            return np.maximum(np.asarray(ep) - tol, 0.0) * 1e3 + np.asarray(eq) + 1e-3 * np.asarray(ep)
        return np.maximum(ep, eq)


def complete_pair(p: np.ndarray, q: np.ndarray, cand: np.ndarray, rp: float, rq: float, window: float,
                  room: tuple[np.ndarray, np.ndarray, int, int] | None = None, chebyshev: bool = False
                  ) -> tuple[float, float, int, int]:
    """The pair of distinct samples of ``cand`` whose summed ``p`` comes within ``window`` of ``rp`` and whose
    summed ``q`` comes closest to ``rq`` (``chebyshev``: whose larger error is the least): (p error, q error, i,
    j); (inf, inf, -1, -1) when no pair comes within ``window`` in p.  room: (items, tokens, items left, tokens
    left), the pair must fit the count caps.

    Sorted buckets: the candidates sorted by (p bucket of width ``window / 2``, q); for every i at once, in each of
    the three buckets around ``rp - p_i`` the partners whose q is nearest ``rq - q_i`` (one on each side, the next
    one out where that is i itself) are found by one ``searchsorted``: O(n log n) for n candidates instead of the n^2
    pairs.  A pair within ``window / 2`` in p lies in those buckets, so a pair is found whenever one exists, and
    its q error is within ``window`` of the best such pair's."""
    n = len(cand)
    if n < 2:
        return math.inf, math.inf, -1, -1
    pc, qc = p[cand], q[cand]
    w = window / 2
    q0 = float(qc.min())
    span = float(qc.max()) - q0 + 1.0
    kp = np.floor(pc / w)
    keys = kp * span + (qc - q0)  # bucket, then q: one float key (exact: |keys| stay far below 2^53 ulps)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    kp = kp.astype(np.int64)
    kc = np.floor((rp - pc) / w).astype(np.int64)
    at = np.minimum(np.maximum(rq - qc - q0, 0.0), span - 1.0)
    kb = np.concatenate((kc, kc - 1, kc + 1))  # the three buckets of every i, at once
    idx = np.arange(n)
    i = np.concatenate((idx, idx, idx))
    pos = np.searchsorted(keys, kb * span + np.concatenate((at, at, at)))
    below, above = order[np.maximum(pos - 1, 0)], order[np.minimum(pos, n - 1)]
    # the nearest partner on each side; where that is i itself, the next one out
    below = np.where(below == i, order[np.maximum(pos - 2, 0)], below)
    above = np.where(above == i, order[np.minimum(pos + 1, n - 1)], above)
    i, j, kb = np.concatenate([i, i]), np.concatenate([below, above]), np.concatenate([kb, kb])
    ep = np.abs(pc[i] + pc[j] - rp)
    ok = (kp[j] == kb) & (j != i) & (ep <= window)
    if room is not None:
        items, tokens, left_items, left_tokens = room
        ok &= (items[cand[i]] + items[cand[j]] <= left_items) & (tokens[cand[i]] + tokens[cand[j]] <= left_tokens)
    if not ok.any():
        return math.inf, math.inf, -1, -1
    i, j, ep = i[ok], j[ok], ep[ok]
    eq = np.abs(qc[i] + qc[j] - rq)
    k = int(np.lexsort((ep, np.maximum(ep, eq) if chebyshev else eq))[0])
    return float(ep[k]), float(eq[k]), int(cand[i[k]]), int(cand[j[k]])


def exact_completion(frame: Frame, items: np.ndarray, tokens: np.ndarray, cand: np.ndarray, rp: float, rq: float,
                     tol: float, left_items: int, left_tokens: int) -> list[int]:
    """The subset of ``cand`` (at most ``EXACT_MAX`` positions) that completes (rp, rq) best (``Frame.score``)
    within ``left_items`` ViT items and ``left_tokens`` tokens; the empty subset when nothing does better than
    nothing.  All 2^k subsets at once; the first of equals in the subsets' binary order."""
    k = len(cand)
    bits = ((np.arange(1 << k)[:, None] >> np.arange(k)[None, :]) & 1).astype(np.float64)
    s = np.asarray(frame.score(np.abs(rp - bits @ frame.p[cand]), np.abs(rq - bits @ frame.q[cand]), tol),
                   dtype=np.float64)
    s[(bits @ items[cand] > left_items) | (bits @ tokens[cand] > left_tokens)] = math.inf
    return [int(q) for q in cand[bits[int(np.argmin(s))] > 0]]


def fill_group(table: BufferCosts, frame: Frame, free: np.ndarray, anchor: int, caps: Caps, tol: float,
               detour: int = 0, look_ahead: bool = False) -> list[int]:
    """One group: ``anchor`` plus samples of ``free`` (bool mask, updated) filled toward the target of ``frame``
    within the count ``caps``; positions in the table, anchor first.  See the module docstring (step 2).
    detour: the first pick before the completion is the ``detour``-th best instead of the best (another try after
    a miss); look_ahead: once the group is ``MISSING_FOR_TRIPLE`` mean samples short or less and no pair completes
    it, try one sample then a pair (``_look_ahead``) before a greedy pick."""
    p, q = frame.p, frame.q
    items, tokens = table.vit_items, table.tokens
    mean_p = frame.mean_p or tol
    gp, gq = frame.goal()
    members = [anchor]
    free[anchor] = False
    sp, sq, si, st = float(p[anchor]), float(q[anchor]), int(items[anchor]), int(tokens[anchor])
    looked = False

    def add(*qs: int) -> None:
        nonlocal sp, sq, si, st
        for k in qs:
            members.append(k)
            free[k] = False
            sp, sq, si, st = sp + float(p[k]), sq + float(q[k]), si + int(items[k]), st + int(tokens[k])

    while True:
        rp, rq = gp - sp, gq - sq
        if frame.reached(abs(rp), abs(rq), tol):
            break
        left_items, left_tokens = caps.vit_items - si, caps.tokens - st
        fit = free & (p <= rp + tol) & (items <= left_items) & (tokens <= left_tokens)
        if not frame.total:
            fit &= q <= rq + tol
        cand = np.flatnonzero(fit)
        if not len(cand):
            break
        if len(cand) <= EXACT_MAX:  # few left: the best subset, searched exhaustively
            add(*exact_completion(frame, items, tokens, cand, rp, rq, tol, left_items, left_tokens))
            break
        ep, eq = np.abs(rp - p[cand]), np.abs(rq - q[cand])
        best = int(np.argmin(frame.score(ep, eq, tol)))
        if frame.reached(float(ep[best]), float(eq[best]), tol):
            add(int(cand[best]))
            break
        missing = rp / mean_p
        pair_may_reach = missing <= MISSING_FOR_PAIR and _top_two(p[cand]) >= rp - 4 * tol
        if pair_may_reach and _complete(frame, table, cand, rp, rq, tol, (left_items, left_tokens), float(ep[best]),
                                        float(eq[best]), int(cand[best]), missing < 1.5, add):
            break
        if missing < 1.5:
            add(int(cand[best]))  # nothing completes the group: the closest single sample
            continue
        m = max(1.0, round(missing) - 1.0)  # leave about m mean samples, of the buffer's mix, to complete
        keep = np.maximum(np.abs(rp - p[cand] - m * mean_p), np.abs(rq - q[cand] - m * frame.mean_q))
        if look_ahead and not frame.total and not looked and missing <= MISSING_FOR_TRIPLE:
            looked = True  # once per group: where it finds nothing, a greedy pick comes next
            if _look_ahead(frame, table, cand, keep, rp, rq, tol, (left_items, left_tokens), add):
                break
        if detour and len(members) == 1 and len(cand) > detour:
            add(int(cand[np.argpartition(keep, detour)[detour]]))
        else:
            add(int(cand[int(np.argmin(keep))]))
    return members


def _top_two(values: np.ndarray) -> float:
    """The sum of the two largest ``values`` (at least two)."""
    return float(np.partition(values, len(values) - 2)[-2:].sum())


def _look_ahead(frame: Frame, table: BufferCosts, cand: np.ndarray, keep: np.ndarray, rp: float, rq: float,
                tol: float, left: tuple[int, int], add) -> bool:
    """Completes a group in (x, y) by one sample and then a pair (``complete_pair``), where no pair alone does: the
    first sample is tried among the best (least ``keep``) of each bucket of ``p`` (width ``4 tol``), ``LOOKAHEAD``
    buckets at most, in that order: the first completion within ``GOOD_ENOUGH`` tolerances is taken, else the one
    with the least larger error within ``4 tol``.  Greedy picks alone dead-end on a lattice of ViT times (whole
    tiles per image): a 3-tile sample picked where a 1-tile one leaves a pair of 5-tile ones.  Returns whether it
    completed."""
    p, q, items, tokens = frame.p, frame.q, table.vit_items, table.tokens
    order = cand[np.argsort(keep, kind="stable")]
    _, first = np.unique(np.floor(p[order] / (4 * tol)), return_index=True)
    firsts = order[np.sort(first)[:LOOKAHEAD]]
    best, best_err = None, 4 * tol
    for i in firsts:
        rp_i, rq_i = rp - float(p[i]), rq - float(q[i])
        left_items, left_tokens = left[0] - int(items[i]), left[1] - int(tokens[i])
        rest = cand[(cand != i) & (p[cand] <= rp_i + 4 * tol) & (q[cand] <= rq_i + 4 * tol)
                    & (items[cand] <= left_items) & (tokens[cand] <= left_tokens)]
        if len(rest) < 2 or _top_two(p[rest]) < rp_i - 4 * tol:
            continue
        ep, eq, j, k = complete_pair(p, q, rest, rp_i, rq_i, 4 * tol, (items, tokens, left_items, left_tokens),
                                     chebyshev=True)
        if max(ep, eq) < best_err:
            best, best_err = (int(i), j, k), max(ep, eq)
            if best_err <= GOOD_ENOUGH * tol:
                break
    if best is None:
        return False
    add(*best)
    return True


def _complete(frame: Frame, table: BufferCosts, cand: np.ndarray, rp: float, rq: float, tol: float,
              left: tuple[int, int], single_p: float, single_q: float, single: int, last: bool, add) -> bool:
    """Completes the group by a pair (``complete_pair``) or the best single sample where one reaches the target:
    within ``4 tol`` in (x, y), the pair closest in q among those nearest in p; the total within ``tol`` and the mix
    as close as it comes in (u, v) (taken when it reaches, or on the ``last`` try).  Returns whether it
    completed."""
    room = (table.vit_items, table.tokens, *left)
    if not frame.total:
        ep, eq, i, j = complete_pair(frame.p, frame.q, cand, rp, rq, 4 * tol, room, chebyshev=True)
        if max(ep, eq) <= 4 * tol:
            add(i, j)
            return True
        return False
    ep, eq, i, j = complete_pair(frame.p, frame.q, cand, rp, rq, tol, room)
    one = single_q if single_p <= tol else math.inf
    if min(eq, one) <= 2 * tol or (last and min(eq, one) < math.inf):
        if eq <= one:
            add(i, j)
        else:
            add(single)
        return True
    return False


def is_skewed(total: Frame) -> bool:
    """Whether a buffer's mean mix (x - y, in the total frame) is off the target's by more than ``MIX_SKEW`` of its
    mean total, and by more than three standard errors of that mean: a skewed shard, where a lattice of tile times
    or chance leaves it near 0 (a buffer of fewer than ``SKEW_MIN_SAMPLES`` samples is too few to tell)."""
    n = len(total.p)
    if n < SKEW_MIN_SAMPLES:
        return False
    off = abs(total.mean_q)
    return off > MIX_SKEW * total.mean_p and off > 3.0 * float(total.q.std()) / math.sqrt(n)


def repair(table: BufferCosts, frame: Frame, free: np.ndarray, members: list[int], caps: Caps, tol: float
           ) -> list[int]:
    """A group that misses its target, improved by exchanging one of its samples (not the anchor, ``members[0]``)
    for one sample of ``free`` (every member tried), else for two (``complete_pair``): the exchange that brings it
    closest (``Frame.score``), if it comes closer; ``free`` is not changed."""
    gp, gq = frame.goal()
    p, q, items, tokens = frame.p, frame.q, table.vit_items, table.tokens
    sp, sq = float(p[members].sum()), float(q[members].sum())
    si, st = int(items[members].sum()), int(tokens[members].sum())
    best, best_score = list(members), float(frame.score(abs(gp - sp), abs(gq - sq), tol))
    needs = []  # per member: (member, what must replace it, the room it leaves, its candidates)
    for m in members[1:]:
        rp, rq = gp - sp + float(p[m]), gq - sq + float(q[m])
        left_items, left_tokens = caps.vit_items - si + int(items[m]), caps.tokens - st + int(tokens[m])
        fit = free & (p <= rp + tol) & (items <= left_items) & (tokens <= left_tokens)
        if not frame.total:
            fit &= q <= rq + tol
        cand = np.flatnonzero(fit)
        if not len(cand):
            continue
        needs.append((m, rp, rq, left_items, left_tokens, cand))
        scores = frame.score(np.abs(rp - p[cand]), np.abs(rq - q[cand]), tol)
        k = int(np.argmin(scores))
        if scores[k] < best_score:
            best, best_score = [x for x in members if x != m] + [int(cand[k])], float(scores[k])
    if frame.reached(*frame.errors(best), tol):
        return best
    for m, rp, rq, left_items, left_tokens, cand in needs:
        if len(cand) < 2 or _top_two(p[cand]) < rp - 4 * tol:
            continue
        ep, eq, i, j = complete_pair(p, q, cand, rp, rq, 4 * tol, (items, tokens, left_items, left_tokens),
                                     chebyshev=not frame.total)
        sc = float(frame.score(ep, eq, tol)) if i >= 0 else math.inf
        if sc < best_score:
            best, best_score = [x for x in members if x != m] + [i, j], sc
        if frame.reached(*frame.errors(best), tol):
            break
    return best


def fill_best(table: BufferCosts, target: Level, free: np.ndarray, anchor: int, caps: Caps, tol: float,
              frames: tuple[Frame, Frame] | None = None) -> list[int]:
    """The group of ``anchor``: ``fill_group`` in (x, y) and, where it misses, ``repair``; tried again with other
    first picks (``detour``) and the look-ahead (``_look_ahead``) while it misses; where the best try still misses
    by more than ``4 tol`` and the buffer's mix is off the target's (``is_skewed``: a skewed shard, not a lattice of
    tile times; then after one try), in (u, v) too, and the better in total time wins.  ``free`` is updated for the
    group returned; ``frames``: the two frames of ``target`` when the caller holds them."""
    dims, total = frames or (Frame.of(table, target, False), Frame.of(table, target, True))
    skewed = is_skewed(total)
    best, best_score = None, math.inf
    for detour in range(1 if skewed else RETRIES + 1):
        trial = free.copy()
        members = fill_group(table, dims, trial, anchor, caps, tol, detour, look_ahead=detour > 0)
        if max(dims.errors(members)) > GOOD_ENOUGH * tol:
            members = repair(table, dims, trial, members, caps, tol)
        err = max(dims.errors(members))
        if err < best_score:
            best, best_score = members, err
        if best_score <= GOOD_ENOUGH * tol:
            break
    if best_score > 4 * tol and skewed:
        trial = free.copy()
        members = fill_group(table, total, trial, anchor, caps, tol)
        members = repair(table, total, trial, members, caps, tol)
        if total.errors(members)[0] < total.errors(best)[0]:
            best = members
    free[best] = False
    return best


def miss(frames: tuple[Frame, Frame], members: list[int]) -> float:
    """How far a group is from its target: the larger error of its two times, or, for a skewed buffer
    (``is_skewed``), of its total time."""
    dims, total = frames
    return total.errors(members)[0] if is_skewed(total) else max(dims.errors(members))


def common_level(lows: Sequence[float], aim: float, skewed: Sequence[bool], slack: float) -> float:
    """The level every rank's groups are leveled off to in one time (ViT or LLM seconds), from each serving rank's
    lowest group ``lows``: the value ``c`` (the highest low, or a lower one) that maximises the share of the step
    spent working, ``sum(min(low, c)) / (ranks * c)``, the highest of those within ``slack`` of the best (leveling
    off costs no idle time, the samples left out wait in the buffer, but it costs a repack; a rank a little low
    among many idles the others for little).  A rank whose buffer's mix is off the target's (``skewed``) counts as
    ``LEVEL_FLOOR`` of the step's ``aim`` at least: it would shrink every group of every step, so it is left
    below instead."""
    lows = np.asarray(lows, dtype=np.float64)
    v = np.where(np.asarray(skewed, dtype=bool), np.maximum(lows, LEVEL_FLOOR * aim), lows)
    cand = np.unique(v[v > 0])
    if not len(cand):
        return float(v.max())
    work = np.minimum(v[None, :], cand[:, None]).sum(axis=1) / (len(v) * cand)
    return float(cand[work >= work.max() - slack].max())


# ----------------------------------------------------------------------------------------------- the rank
@dataclass(frozen=True)
class _Proposal:
    """A step between ``propose`` and ``settle``: the buffer's table, the groups packed, the caps and target used,
    the steps each buffered sample has waited."""

    table: BufferCosts
    groups: list
    caps: Caps
    target: Level
    ages: np.ndarray
    missed: np.ndarray


class OnlineISF:
    """The online ISF of one DP rank (module docstring).  Call ``next_step_groups`` once per step on every rank."""

    def __init__(self, config: OnlineISFConfig):
        self.config = config
        self._step = 0
        self._target: Level | None = None  # agreed at the end of the previous step
        self._caps: Caps | None = (Caps(config.max_vit_items, config.max_tokens)
                                   if config.max_vit_items is not None and config.max_tokens is not None else None)
        self._ages = np.zeros(0, dtype=np.int64)  # steps waited by the entries kept (the front of the next buffer)
        self._missed = np.zeros(0, dtype=np.int64)  # the step each kept entry last missed as a group's start
        self._seen = np.zeros(5)  # count, ViT s, LLM s, ViT items, tokens of every sample seen
        self._seen_max = np.zeros(2)  # largest ViT items, tokens seen
        self._done = False
        self._proposal: _Proposal | None = None  # between propose and settle

    # -- public -------------------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps planned so far."""
        return self._step

    @property
    def done(self) -> bool:
        """Every rank's stream had ended and every buffer was empty at the last step (which served nothing)."""
        return self._done

    @property
    def target(self) -> Level | None:
        """The group target of the next step (None before the first)."""
        return self._target

    @property
    def caps(self) -> Caps | None:
        """The hard count caps (None until configured or set at the first step)."""
        return self._caps

    def observe(self, costs: BufferCosts) -> None:
        """Count samples entering the buffer in the online statistics (``next_step_groups`` calls it on the
        buffer's new entries)."""
        if not len(costs):
            return
        self._seen += [len(costs), costs.vit_s.sum(), costs.llm_s.sum(), costs.vit_items.sum(), costs.tokens.sum()]
        self._seen_max = np.maximum(self._seen_max, [costs.vit_items.max(), costs.tokens.max()])

    def next_step_groups(self, buffer: Sequence[SampleCost] | BufferCosts, exchange: Exchange, final: bool = False
                         ) -> list[list[int]]:
        """This rank's groups for the next step, each a list of positions in ``buffer`` (this rank's look-ahead,
        oldest first). Every rank calls it once per step with its own buffer; ``final``: the stream has ended,
        serve what is left.

        Between calls the caller removes the served positions (keeping the others in order) and appends new
        samples at the end.  Fewer than ``groups_per_step`` groups (none on a rank whose buffer is empty) come back
        only at the end of a stream.  The same as ``propose``, the exchange, then ``settle``."""
        return self.settle(exchange(self.propose(buffer, final)))

    def propose(self, buffer: Sequence[SampleCost] | BufferCosts, final: bool = False) -> np.ndarray:
        """The first half of a step: pack toward the agreed target; returns this rank's summary vector (what
        ``next_step_groups`` all-gathers; ``settle`` takes the gathered matrix)."""
        if self._proposal is not None:
            raise RuntimeError("online ISF: propose called twice without settle")
        table = BufferCosts.of(buffer)
        n = len(table)
        kept = len(self._ages)
        if n < kept:
            raise ValueError(f"online ISF: the buffer holds {n} samples, fewer than the {kept} kept from "
                             f"the last step (remove only the served positions)")
        self.observe(table.take(np.arange(kept, n)))
        ages = np.concatenate([self._ages, np.zeros(n - kept, dtype=np.int64)])
        missed = np.concatenate([self._missed, np.full(n - kept, NEVER, dtype=np.int64)])
        caps = self._caps or self._derived_caps(self._seen, self._seen_max)
        self._check_oversize(table, caps)
        target = self._target or self._nominal(self._seen)
        groups = self._pack(table, np.ones(n, dtype=bool), target, caps, ages, missed) if n else []
        self._proposal = _Proposal(table, groups, caps, target, ages, missed)
        return self._summary(table, groups, final, n > 0 and is_skewed(Frame.of(table, target, True))).vector()

    def settle(self, gathered: np.ndarray) -> list[list[int]]:
        """The second half of a step: from every rank's summary (the all-gathered ``propose`` vectors, one row per
        rank) level this rank's groups off and agree on the next target; returns the step's groups."""
        if self._proposal is None:
            raise RuntimeError("online ISF: settle called without propose")
        p, self._proposal = self._proposal, None
        rows = Summaries.of(gathered, self.config.ranks)
        table, groups, caps = p.table, p.groups, p.caps
        if self._caps is None:  # fixed from what all ranks have seen at the first step
            seen, seen_max = self._global_seen(rows)
            self._caps = self._derived_caps(seen, seen_max)
            if self._caps != caps:
                caps = self._caps
                self._check_oversize(table, caps)
                groups = (self._pack(table, np.ones(len(table), dtype=bool), p.target, caps, p.ages, p.missed)
                          if len(table) else [])
        groups = self._level_off(table, groups, rows, caps, p.target, p.ages, p.missed)
        self._target = self._next_target(rows)
        self._done = bool(np.all((rows.column("ended") > 0) & (rows.column("buffered") == 0)))
        kept = np.ones(len(table), dtype=bool)
        for g in groups:
            kept[g] = False
        self._ages = p.ages[kept] + 1
        self._missed = p.missed[kept]
        self._step += 1
        return groups

    def state_dict(self) -> dict:
        """JSON-able state; with the same buffer (same samples, same order) ``load_state_dict`` resumes exactly."""
        return {"step": self._step, "target": None if self._target is None else asdict(self._target),
                "caps": None if self._caps is None else asdict(self._caps), "ages": self._ages.tolist(),
                "missed": self._missed.tolist(),
                "seen": self._seen.tolist(), "seen_max": self._seen_max.tolist(), "done": self._done,
                "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s state; refused (naming the field) when it was saved under another config."""
        saved = state.get("config", {})
        for key, value in asdict(self.config).items():
            if key in saved and saved[key] != value:
                raise UserError(f"online ISF state: saved with {key}={saved[key]!r}, this run has {value!r}")
        self._step = int(state["step"])
        self._target = None if state["target"] is None else Level(**state["target"])
        self._caps = None if state["caps"] is None else Caps(**state["caps"])
        self._ages = np.asarray(state["ages"], dtype=np.int64)
        self._missed = np.asarray(state["missed"], dtype=np.int64)
        self._seen = np.asarray(state["seen"], dtype=np.float64)
        self._seen_max = np.asarray(state["seen_max"], dtype=np.float64)
        self._done = bool(state["done"])

    # -- steps --------------------------------------------------------------------------------------------
    def _pack(self, table: BufferCosts, free: np.ndarray, target: Level, caps: Caps, ages: np.ndarray,
              missed: np.ndarray) -> list[list[int]]:
        """Up to ``groups_per_step`` groups of ``free`` positions (updated) toward ``target`` (``_compose``);
        oversize samples (``solo``) form their own groups."""
        groups = []
        over = self._over(table, caps)
        for _ in range(self.config.groups_per_step):
            left = np.flatnonzero(free)
            if not len(left):
                break
            if over[left[0]]:  # oversize="solo": a group of its own
                free[left[0]] = False
                groups.append([int(left[0])])
                continue
            groups.append(self._compose(table, free, over, target, caps, ages, missed))
        return groups

    def _compose(self, table: BufferCosts, free: np.ndarray, over: np.ndarray, target: Level, caps: Caps,
                 ages: np.ndarray, missed: np.ndarray, first: int | None = None) -> list[int]:
        """One group toward ``target`` (``_group``).  Under CP, ``cp`` parts toward ``target / cp`` each, within
        ``ceil(ViT items cap / cp)`` items each, one after the other: the trainer's contiguous split of the group's
        images over its CP ranks then finds parts as even as the parts are (module docstring)."""
        cp = self.config.cp
        if cp == 1:
            frames = (Frame.of(table, target, False), Frame.of(table, target, True))
            return self._group(table, free, over, frames, caps, ages, missed, first)
        part = Level(target.vit_s / cp, target.llm_s / cp)
        frames = (Frame.of(table, part, False), Frame.of(table, part, True))
        group: list[int] = []
        for _ in range(cp):
            if not (free & ~over).any():
                break
            room = Caps(-(-caps.vit_items // cp), caps.tokens - int(table.tokens[group].sum()))
            fits = (table.vit_items <= room.vit_items) & (table.tokens <= room.tokens)
            if first is None and not (free & ~over & fits).any():
                break
            group += self._group(table, free, over | ~fits if first is None else over, frames, room, ages, missed,
                                 first)
            first = None
        return group

    def _group(self, table: BufferCosts, free: np.ndarray, over: np.ndarray, frames: tuple[Frame, Frame], caps: Caps,
               ages: np.ndarray, missed: np.ndarray, first: int | None = None) -> list[int]:
        """One group of ``free`` positions (updated; ``over``: oversize, left out) toward the target of ``frames``.
        It starts from the oldest free sample (``ages``: steps each has waited; ``first``: this one before the
        others) that has not missed as a start within ``ANCHOR_COOLDOWN`` steps (``missed``: the step of its last
        miss, updated); where that one misses the target, from the next (up to ``ANCHOR_TRIES``): the best try
        wins, the oldest among equals.  A sample that has waited ``max_wait_steps`` starts it whatever."""
        left = np.flatnonzero(free & ~over)
        if ages[left[0]] >= self.max_wait:
            anchors = left[:1]
        else:
            ready = left[missed[left] <= self._step - ANCHOR_COOLDOWN]
            anchors = ready[:ANCHOR_TRIES] if len(ready) else left[:1]
        if first is not None:
            anchors = [first] + [a for a in anchors if a != first][:ANCHOR_TRIES - 1]
        tol = self.config.tolerance
        best, best_err = None, math.inf
        for anchor in anchors:
            members = fill_best(table, frames[0].target, free & ~over, int(anchor), caps, tol, frames)
            err = miss(frames, members)
            if err < best_err:
                best, best_err = members, err
            if err <= GOOD_ENOUGH * tol:
                break
            missed[anchor] = self._step
        free[best] = False
        return best

    @property
    def max_wait(self) -> int:
        """Steps the oldest sample may be passed over before a group must start from it."""
        cfg = self.config
        return cfg.max_wait_steps if cfg.max_wait_steps is not None else max(1, cfg.buffer_size // cfg.groups_per_step)

    def _level_off(self, table: BufferCosts, groups: list[list[int]], rows: Summaries, caps: Caps, target: Level,
                   ages: np.ndarray, missed: np.ndarray) -> list[list[int]]:
        """Step 3 of the module docstring: this rank's groups more than 2 x tolerance above the common level
        (``common_level`` of each time apart) are repacked toward it, from the same anchor; returns the step's
        groups."""
        serving = (rows.column("serving") > 0) & (rows.column("groups") > 0)
        if not serving.any() or not groups:
            return groups
        tol = self.config.tolerance

        skewed = rows.column("skewed")[serving] > 0
        goal = Level(common_level(rows.column("min_vit_s")[serving], target.vit_s, skewed, tol / 2),
                     common_level(rows.column("min_llm_s")[serving], target.llm_s, skewed, tol / 2))
        high = [k for k, g in enumerate(groups)
                if len(g) > 1 and (float(table.vit_s[g].sum()) > goal.vit_s * (1 + 2 * tol) + 1e-12
                                   or float(table.llm_s[g].sum()) > goal.llm_s * (1 + 2 * tol) + 1e-12)]
        if not high:
            return groups
        free = np.ones(len(table), dtype=bool)
        for g in groups:
            free[g] = False
        over = self._over(table, caps)
        goal = Level(goal.vit_s * (1 + tol), goal.llm_s * (1 + tol))
        frames = (Frame.of(table, goal, False), Frame.of(table, goal, True))
        out = list(groups)
        for k in high:
            free[groups[k]] = True
            new = self._compose(table, free, over, goal, caps, ages, missed, first=groups[k][0])
            if miss(frames, new) >= miss(frames, groups[k]):  # the repack comes no closer: keep the group
                free[new] = True
                free[groups[k]] = False
                new = groups[k]
            out[k] = new
        return out

    def _next_target(self, rows: Summaries) -> Level | None:
        """Step 4: the median rank's mean group pulled ``TARGET_PULL`` of the way toward the nominal target; every
        ``PROBE_EVERY`` steps the nominal target itself (a level a lattice of group times would otherwise keep
        from ever coming back up to)."""
        seen, _ = self._global_seen(rows)
        buffered = (float(rows.column("buffer_vit_s").sum()), float(rows.column("buffer_llm_s").sum()))
        nominal = self._nominal(seen, buffered)
        serving = (rows.column("serving") > 0) & (rows.column("groups") > 0)
        if not serving.any() or (self._step + 1) % PROBE_EVERY == 0:
            return nominal
        groups = rows.column("groups")[serving]
        med = Level(float(np.median(rows.column("sum_vit_s")[serving] / groups)),
                    float(np.median(rows.column("sum_llm_s")[serving] / groups)))
        if med.llm_s < 0.5 * nominal.llm_s:  # a tail step (ranks drained): aim at the nominal target again
            return nominal
        return Level(med.vit_s + TARGET_PULL * (nominal.vit_s - med.vit_s),
                     med.llm_s + TARGET_PULL * (nominal.llm_s - med.llm_s))

    # -- helpers ------------------------------------------------------------------------------------------
    def _nominal(self, seen: np.ndarray, buffered: tuple[float, float] | None = None) -> Level:
        """The nominal target: the configured group times, else ``samples_per_group`` times the mean sample seen;
        split between ViT and LLM at the mix of the samples the ranks hold (``buffered``: their ViT and LLM
        seconds), so that the groups take what waits in the buffers as it comes (samples of an uncommon mix do
        not pile up there), else at the nominal's own mix."""
        cfg = self.config
        count = max(seen[0], 1.0)
        k = cfg.samples_per_group * cfg.cp
        vit = cfg.vit_time_s if cfg.vit_time_s is not None else k * seen[1] / count
        llm = cfg.llm_time_s if cfg.llm_time_s is not None else k * seen[2] / count
        if llm <= 0:
            llm = 1.0
        if buffered is not None and buffered[1] > 0:
            share = buffered[0] / (buffered[0] + buffered[1])
            vit, llm = (vit + llm) * share, (vit + llm) * (1 - share)
        return Level(float(vit), float(llm))

    def _derived_caps(self, seen: np.ndarray, seen_max: np.ndarray) -> Caps:
        cfg = self.config
        return count_caps_from_stats(seen, seen_max, cfg.samples_per_group * cfg.cp, cfg.max_vit_items, cfg.max_tokens)

    @staticmethod
    def _global_seen(rows: Summaries) -> tuple[np.ndarray, np.ndarray]:
        seen = np.array([rows.column(f).sum()
                         for f in ("seen", "seen_vit_s", "seen_llm_s", "seen_vit_items", "seen_tokens")])
        return seen, np.array([rows.column("max_vit_items").max(), rows.column("max_tokens").max()])

    def _over(self, table: BufferCosts, caps: Caps) -> np.ndarray:
        return (table.vit_items > caps.vit_items) | (table.tokens > caps.tokens)

    def _check_oversize(self, table: BufferCosts, caps: Caps) -> None:
        if self.config.oversize != "error" or not len(table):
            return
        over = np.flatnonzero(self._over(table, caps))
        if len(over):
            p = int(over[0])
            raise OnlineOversizeError(
                f"buffer position {p}: {int(table.vit_items[p])} ViT items and {int(table.tokens[p])} tokens exceed "
                f"the group caps ({caps.vit_items} ViT items, {caps.tokens} tokens); raise the caps or choose "
                f"oversize='solo'", p)

    @staticmethod
    def _times(table: BufferCosts, group: list[int]) -> tuple[float, float]:
        return float(table.vit_s[group].sum()), float(table.llm_s[group].sum())

    def _summary(self, table: BufferCosts, groups: list[list[int]], final: bool, skewed: bool) -> StepSummary:
        times = np.array([self._times(table, g) for g in groups]).reshape(-1, 2)
        lo = times.min(axis=0) if len(times) else np.full(2, math.inf)
        return StepSummary(
            serving=float(bool(groups)), min_vit_s=float(lo[0]), min_llm_s=float(lo[1]),
            sum_vit_s=float(times[:, 0].sum()), sum_llm_s=float(times[:, 1].sum()), groups=float(len(groups)),
            buffered=float(len(table)), buffer_vit_s=float(table.vit_s.sum()),
            buffer_llm_s=float(table.llm_s.sum()), ended=float(final), skewed=float(skewed),
            seen=float(self._seen[0]), seen_vit_s=float(self._seen[1]), seen_llm_s=float(self._seen[2]),
            seen_vit_items=float(self._seen[3]), seen_tokens=float(self._seen[4]),
            max_vit_items=float(self._seen_max[0]), max_tokens=float(self._seen_max[1]))


def count_caps_from_stats(seen: np.ndarray, seen_max: np.ndarray, samples_per_group: float,
                          max_vit_items: int | None = None, max_tokens: int | None = None) -> Caps:
    """Count caps from statistics (``seen`` = count and sums of ViT s, LLM s, ViT items, tokens; ``seen_max`` =
    largest ViT items, tokens): the given ones, else twice (tokens) / two and a half times (items) the mean group of
    ``samples_per_group`` samples, never below the largest sample seen (as ``search_time.count_caps``)."""
    count = max(float(seen[0]), 1.0)
    k = samples_per_group
    qv = max_vit_items if max_vit_items is not None else max(int(seen_max[0]), math.ceil(2.5 * k * seen[3] / count))
    qt = max_tokens if max_tokens is not None else max(int(seen_max[1]), math.ceil(2.0 * k * seen[4] / count), 1)
    return Caps(int(qv), int(qt))
