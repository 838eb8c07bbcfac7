"""Pipeline partition: which contiguous slice of the unit list each pipeline stage runs.

Stage time is the sum over its units of ``fwd_s + bwd_s`` (plus the recompute extra when a
recompute plan is given: ``selective_recompute_s`` for "selective", ``fwd_s`` for "full").

Planners (each returns a ``PartitionReport``):

* ``default_partition``: Megatron's layout (``layout.default_layout``: ViT, projector and LLM
  embedding on stage 0, LLM layers uniform).
* ``param_split``: balance parameter counts (the smallest possible largest-stage parameter count).
* ``search_partition``: the paper's search. An anchor partition cuts where the cumulative stage
  time is nearest to ``k * total / K`` (K = pp * vpp chunks); candidates shift each of the K-1
  boundaries by any amount in ``[-radius, radius]`` (all combinations); every stage non-empty and
  accepted by ``stage_ok``; ranked by the variance of stage time, then by total pipeline
  communication (``send_bytes`` plus ``side_send_bytes`` of the unit before each boundary). Without virtual stages the
  best candidate is found by dynamic programming over the windows (exact over all
  ``(2r+1)^(K-1)`` combinations: both keys are sums over stages); with virtual stages the
  combinations are enumerated when there are at most ``max_candidates`` of them, else the
  windows are searched by coordinate descent.
* ``optimal_partition``: without virtual stages, the exact optimum of the slowest-stage time over
  ALL contiguous splits (dynamic programming), ties broken by variance then communication. With
  virtual stages (stage time = sum of non-adjacent chunks) no exact method is implemented: a
  coordinate descent on (slowest stage, variance, communication) from the best of the other
  planners; ``exact`` is False in its report and the gap is then relative to the best found.

Layouts with virtual stages hold ``pp * vpp`` chunk counts in pipeline order; chunk ``c`` runs on
stage ``c % pp`` (Megatron's interleaved assignment).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import UserError
from .costs import CostTable
from .layout import PipelineLayout, default_layout
from .spec import ModelSpec, Unit

StageOk = Callable[[int, object], bool]  # (stage index, range | tuple of ranges) -> acceptable?
RECOMPUTE_MODES = ("none", "selective", "full")
_REL_TIE = 1e-9  # relative tolerance when comparing floating keys


class PartitionError(UserError):
    """No partition satisfies the request (too many stages, or every candidate rejected)."""


@dataclass(frozen=True)
class PartitionReport:
    """A layout and what it costs.

    stage_times_s: per pipeline stage, seconds of forward + backward (+ recompute) per micro-batch.
    stage_send_bytes: per stage, bytes it sends forward per micro-batch (to the next chunk).
    stage_act_bytes: per stage, activation bytes kept for backward per micro-batch.
    bottleneck_over_mean: max / mean of stage_times_s.
    gap_to_optimum: bottleneck / optimal bottleneck - 1 (None when not computed).
    search_seconds: wall time the planner took.
    """

    method: str
    layout: PipelineLayout
    flag: str | None
    stage_times_s: tuple[float, ...]
    stage_send_bytes: tuple[float, ...]
    stage_act_bytes: tuple[float, ...]
    bottleneck_over_mean: float
    gap_to_optimum: float | None
    search_seconds: float
    vpp: int = 1
    exact: bool = True  # for "optimal": whether the optimum is proven
    candidates: int = 0  # how many candidate layouts the planner compared (0: not applicable)

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_times_s)

    @property
    def comm_bytes(self) -> float:
        return float(sum(self.stage_send_bytes))

    def with_gap(self, optimum_s: float) -> "PartitionReport":
        return _replace(self, gap_to_optimum=self.bottleneck_s / optimum_s - 1.0 if optimum_s > 0 else 0.0)

    def to_dict(self, num_units: int | None = None) -> dict:
        return {
            "method": self.method,
            "stage_layers": list(self.layout.stage_units),
            "vpp": self.vpp,
            "flag": self.flag,
            "stage_times_s": list(self.stage_times_s),
            "stage_send_bytes": list(self.stage_send_bytes),
            "stage_act_bytes": list(self.stage_act_bytes),
            "bottleneck_s": self.bottleneck_s,
            "bottleneck_over_mean": self.bottleneck_over_mean,
            "gap_to_optimum": self.gap_to_optimum,
            "comm_bytes": self.comm_bytes,
            "search_seconds": self.search_seconds,
            "exact": self.exact,
            "candidates": self.candidates,
        }


def _replace(report: PartitionReport, **changes) -> PartitionReport:
    return dataclasses.replace(report, **changes)


# ----------------------------------------------------------------------------------------------
# Unit weights
# ----------------------------------------------------------------------------------------------
def recompute_modes(costs: CostTable, recompute: Mapping[str, str] | Sequence[str] | None) -> list[str]:
    """Per-unit recompute mode from a {unit name: mode} map or a per-unit list (None: all "none")."""
    n = len(costs.units)
    if recompute is None:
        return ["none"] * n
    if isinstance(recompute, Mapping):
        names = {u.name for u in costs.units}
        unknown = set(recompute) - names
        if unknown:
            raise ValueError(f"recompute plan names units the cost table lacks: {sorted(unknown)[:5]}")
        modes = [recompute.get(u.name, "none") for u in costs.units]
    else:
        modes = list(recompute)
        if len(modes) != n:
            raise ValueError(f"recompute plan has {len(modes)} entries but the cost table has {n} units")
    for u, m in zip(costs.units, modes):
        if m not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode {m!r} for unit {u.name!r}; modes: {', '.join(RECOMPUTE_MODES)}")
    return modes


def unit_arrays(costs: CostTable, recompute=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time seconds, send bytes, activation bytes) per unit under a recompute plan."""
    modes = recompute_modes(costs, recompute)
    t, send, act = [], [], []
    for u, m in zip(costs.units, modes):
        extra = {"none": 0.0, "selective": u.selective_recompute_s, "full": u.fwd_s}[m]
        kept = {"none": u.act_bytes, "selective": u.act_bytes_selective, "full": u.act_bytes_full}[m]
        t.append(u.fwd_s + u.bwd_s + extra)
        send.append(u.send_bytes + u.side_send_bytes)  # the hidden states and the side tensors live there
        act.append(kept)
    return np.asarray(t, float), np.asarray(send, float), np.asarray(act, float)


def _units_of(costs: CostTable) -> list[Unit]:
    return [Unit(u.name, u.kind, i, u.code) for i, u in enumerate(costs.units)]


# ----------------------------------------------------------------------------------------------
# Evaluating layouts (arrays)
# ----------------------------------------------------------------------------------------------
def _check_split(n: int, pp: int, vpp: int) -> int:
    if pp < 1 or vpp < 1:
        raise PartitionError(f"pipeline size {pp} and virtual stages {vpp} must be >= 1")
    k = pp * vpp
    if k > n:
        raise PartitionError(f"{pp} stages x {vpp} virtual chunks = {k} chunks but the model has only {n} units")
    return k


def counts_to_bounds(counts: Sequence[int]) -> np.ndarray:
    """Chunk counts -> the K-1 interior boundaries (index of each chunk's first unit after chunk 0)."""
    return np.cumsum(np.asarray(counts, dtype=int))[:-1]


def bounds_to_counts(bounds: Sequence[int], n: int) -> tuple[int, ...]:
    edges = np.concatenate([[0], np.asarray(bounds, dtype=int), [n]])
    return tuple(int(x) for x in np.diff(edges))


def stage_loads(values: np.ndarray, counts: Sequence[int], pp: int) -> np.ndarray:
    """Per-stage sums of ``values`` when chunk c (of ``counts``) runs on stage ``c % pp``."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    edges = np.concatenate([[0], np.cumsum(counts)])
    chunk = prefix[edges[1:]] - prefix[edges[:-1]]
    return chunk.reshape(-1, pp).sum(axis=0)


def stage_sends(send: np.ndarray, counts: Sequence[int], pp: int) -> np.ndarray:
    """Per-stage bytes sent forward: the output of each chunk's last unit, except the final chunk."""
    ends = np.cumsum(counts)
    chunk = np.asarray(send, float)[ends - 1].copy()
    chunk[-1] = 0.0
    return chunk.reshape(-1, pp).sum(axis=0)


def evaluate_counts(w, send, act, counts, pp, method="given", search_seconds=0.0, units=None, **kw) -> PartitionReport:
    counts = tuple(int(c) for c in counts)
    if len(counts) % pp:
        raise PartitionError(f"{len(counts)} chunks are not a multiple of pipeline size {pp}")
    if any(c <= 0 for c in counts) or sum(counts) != len(w):
        raise PartitionError(f"layout counts {list(counts)} must be positive and sum to {len(w)} units")
    times = stage_loads(w, counts, pp)
    layout = PipelineLayout(counts)
    return PartitionReport(
        method=method,
        layout=layout,
        flag=layout.to_flag(units) if units is not None else None,
        stage_times_s=tuple(float(x) for x in times),
        stage_send_bytes=tuple(float(x) for x in stage_sends(send, counts, pp)),
        stage_act_bytes=tuple(float(x) for x in stage_loads(act, counts, pp)),
        bottleneck_over_mean=float(times.max() / times.mean()) if times.mean() > 0 else 1.0,
        gap_to_optimum=None,
        search_seconds=search_seconds,
        vpp=len(counts) // pp,
        **kw,
    )


def evaluate_layout(costs: CostTable, layout: PipelineLayout, pp: int, recompute=None, method="given") -> PartitionReport:
    """The report of a given layout (``pp * vpp`` chunk counts) under ``costs``."""
    w, send, act = unit_arrays(costs, recompute)
    return evaluate_counts(w, send, act, layout.stage_units, pp, method, units=_units_of(costs))


def _stage_ranges(bounds: Sequence[int], n: int, pp: int) -> list[tuple[range, ...]]:
    edges = np.concatenate([[0], np.asarray(bounds, dtype=int), [n]])
    chunks = [range(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]
    return [tuple(chunks[s::pp]) for s in range(pp)]


def _layout_ok(stage_ok: StageOk | None, bounds, n: int, pp: int) -> bool:
    if stage_ok is None:
        return True
    for s, ranges in enumerate(_stage_ranges(bounds, n, pp)):
        if not stage_ok(s, ranges[0] if len(ranges) == 1 else ranges):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Dynamic programming over contiguous splits (no virtual stages)
# ----------------------------------------------------------------------------------------------
def _ok_matrix(stage_ok: StageOk | None, k: int, n: int, rows, cols) -> np.ndarray:
    """ok[i, j]: part k may hold units [i, j) (only rows x cols asked)."""
    ok = np.ones((n + 1, n + 1), dtype=bool)
    if stage_ok is None:
        return ok
    for i in rows:
        for j in cols:
            if j > i:
                ok[i, j] = bool(stage_ok(k, range(int(i), int(j))))
    return ok


def _min_bottleneck(w: np.ndarray, k_parts: int, stage_ok: StageOk | None) -> float:
    """The smallest possible slowest-part time of a contiguous split of ``w`` into ``k_parts`` non-empty parts."""
    n = len(w)
    S = np.concatenate([[0.0], np.cumsum(w)])
    L = S[None, :] - S[:, None]  # L[i, j] = sum of units [i, j)
    idx = np.arange(n + 1)
    lower = idx[:, None] < idx[None, :]
    f = np.where((idx >= 1) & _ok_matrix(stage_ok, 0, n, [0], range(n + 1))[0], S, np.inf)
    f[0] = np.inf
    for k in range(1, k_parts):
        ok = _ok_matrix(stage_ok, k, n, range(k, n), range(k + 1, n + 1))
        M = np.where(lower & ok, np.maximum(f[:, None], L), np.inf)
        f = M.min(axis=0)
    return float(f[n])


def _lex_dp(
    w: np.ndarray,
    send: np.ndarray,
    k_parts: int,
    allowed_ends: list[np.ndarray] | None,
    max_part: float,
    stage_ok: StageOk | None,
) -> tuple[int, ...] | None:
    """Contiguous split into ``k_parts`` minimising (sum of squared part times, total send bytes).

    allowed_ends[k]: boolean mask over 0..n of where part k may end (None: anywhere); every part's
    time must be <= max_part. Returns the part counts, or None when no split qualifies.
    """
    n = len(w)
    S = np.concatenate([[0.0], np.cumsum(w)])
    L = S[None, :] - S[:, None]
    idx = np.arange(n + 1)
    fits = (idx[:, None] < idx[None, :]) & (L <= max_part * (1 + _REL_TIE) + 1e-300)
    comm_at_end = np.concatenate([[0.0], send])  # ending at j sends unit j-1's output
    comm_at_end[n] = 0.0
    inf = np.inf
    g1 = np.full(n + 1, inf)
    g2 = np.full(n + 1, inf)
    g1[0] = g2[0] = 0.0
    parents = []
    prev_ends = np.zeros(n + 1, dtype=bool)
    prev_ends[0] = True
    for k in range(k_parts):
        ends = np.zeros(n + 1, dtype=bool)
        if k == k_parts - 1:
            ends[n] = True
        else:
            ends[k + 1 : n - (k_parts - k - 1) + 1] = True
            if allowed_ends is not None:
                ends &= allowed_ends[k]
        rows = np.flatnonzero(prev_ends & np.isfinite(g1))
        cols = np.flatnonzero(ends)
        ok = _ok_matrix(stage_ok, k, n, rows, cols)
        valid = fits & ok & (prev_ends & np.isfinite(g1))[:, None] & ends[None, :]
        P = np.where(valid, g1[:, None] + L**2, inf)
        best1 = P.min(axis=0)
        near = valid & (P <= best1[None, :] * (1 + _REL_TIE) + 1e-300)
        Q = np.where(near, g2[:, None] + comm_at_end[None, :], inf)
        parent = Q.argmin(axis=0)
        cols_all = np.arange(n + 1)
        g1 = np.where(np.isfinite(best1), P[parent, cols_all], inf)
        g2 = np.where(np.isfinite(best1), Q[parent, cols_all], inf)
        parents.append(parent)
        prev_ends = ends & np.isfinite(g1)
    if not np.isfinite(g1[n]):
        return None
    edges = [n]
    for k in range(k_parts - 1, -1, -1):
        edges.append(int(parents[k][edges[-1]]))
    edges = edges[::-1]
    return tuple(int(b - a) for a, b in zip(edges[:-1], edges[1:]))


# ----------------------------------------------------------------------------------------------
# Keys and the anchor
# ----------------------------------------------------------------------------------------------
def anchor_bounds(w: np.ndarray, k_parts: int) -> np.ndarray:
    """Greedy anchor: boundary k at the prefix nearest ``k * total / k_parts``, kept strictly
    increasing with room for one unit per remaining part."""
    n = len(w)
    S = np.concatenate([[0.0], np.cumsum(w)])
    total = S[-1]
    bounds = []
    lo = 1
    for k in range(1, k_parts):
        hi = n - (k_parts - k)
        target = k * total / k_parts
        j = int(np.searchsorted(S, target))  # S[j-1] < target <= S[j]
        cands = [c for c in (j - 1, j) if lo <= c <= hi]
        b = min(cands, key=lambda c: abs(S[c] - target)) if cands else min(max(j, lo), hi)
        bounds.append(b)
        lo = b + 1
    return np.asarray(bounds, dtype=int)


def _keys(w: np.ndarray, send: np.ndarray, bounds: np.ndarray, pp: int) -> np.ndarray:
    """For candidate boundary rows (N, K-1): columns (max stage time, sum of squares, comm bytes)."""
    bounds = np.atleast_2d(bounds)
    n = len(w)
    S = np.concatenate([[0.0], np.cumsum(w)])
    N = bounds.shape[0]
    edges = np.concatenate([np.zeros((N, 1), int), bounds, np.full((N, 1), n)], axis=1)
    chunk = S[edges[:, 1:]] - S[edges[:, :-1]]
    stage = chunk.reshape(N, -1, pp).sum(axis=1)
    comm = send[bounds - 1].sum(axis=1) if bounds.shape[1] else np.zeros(N)
    return np.stack([stage.max(axis=1), (stage**2).sum(axis=1), comm], axis=1)


def _lex_best(keys: np.ndarray, order: Sequence[int]) -> int:
    """Index of the lexicographically smallest row of ``keys`` over columns ``order`` (relative ties)."""
    cand = np.arange(len(keys))
    for col in order:
        v = keys[cand, col]
        m = v.min()
        cand = cand[v <= m + abs(m) * _REL_TIE + 1e-300]
    return int(cand[0])


def _coordinate_descent(w, send, bounds, pp, order, windows=None, stage_ok=None, max_passes=100):
    """Move one boundary at a time to its best position (within its window and its neighbours)."""
    n = len(w)
    bounds = np.asarray(bounds, int).copy()
    best = _keys(w, send, bounds, pp)[0]
    for _ in range(max_passes):
        improved = False
        for k in range(len(bounds)):
            lo = bounds[k - 1] + 1 if k > 0 else 1
            hi = bounds[k + 1] - 1 if k + 1 < len(bounds) else n - 1
            if windows is not None:
                lo, hi = max(lo, windows[k][0]), min(hi, windows[k][1])
            if hi <= lo:
                continue
            trial = np.repeat(bounds[None, :], hi - lo + 1, axis=0)
            trial[:, k] = np.arange(lo, hi + 1)
            keys = _keys(w, send, trial, pp)
            if stage_ok is not None:
                fine = np.array([_layout_ok(stage_ok, t, n, pp) for t in trial])
                if not fine.any():
                    continue
                trial, keys = trial[fine], keys[fine]
            i = _lex_best(np.vstack([best[None, :], keys]), order)
            if i > 0 and not np.array_equal(trial[i - 1], bounds):
                bounds, best = trial[i - 1].copy(), keys[i - 1]
                improved = True
        if not improved:
            break
    return bounds


# ----------------------------------------------------------------------------------------------
# Planners on arrays
# ----------------------------------------------------------------------------------------------
def search_counts(
    w: np.ndarray, send: np.ndarray, pp: int, vpp: int = 1, radius: int = 2,
    stage_ok: StageOk | None = None, max_candidates: int = 200_000,
) -> tuple[tuple[int, ...], int]:
    """The paper's anchor + radius search. Returns (chunk counts, candidates considered)."""
    n = len(w)
    k_parts = _check_split(n, pp, vpp)
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    if k_parts == 1:
        return (n,), 1
    anchor = anchor_bounds(w, k_parts)
    windows = [(max(1, b - radius), min(n - 1, b + radius)) for b in anchor]
    n_cand = int(np.prod([hi - lo + 1 for lo, hi in windows], dtype=float)) if k_parts > 1 else 1
    if vpp == 1:
        allowed = []
        for lo, hi in windows:
            mask = np.zeros(n + 1, dtype=bool)
            mask[lo : hi + 1] = True
            allowed.append(mask)
        counts = _lex_dp(w, send, k_parts, allowed, np.inf, stage_ok)
        if counts is None:
            raise PartitionError(
                f"partition search: no layout within radius {radius} of the anchor passes the stage check; "
                "raise the radius or relax the memory limit"
            )
        return counts, n_cand
    order = (1, 2)  # variance (sum of squares at a fixed total), then communication
    if n_cand <= max_candidates:
        grid = np.array(list(itertools.product(*[range(lo, hi + 1) for lo, hi in windows])), dtype=int)
        grid = grid[np.all(np.diff(grid, axis=1) > 0, axis=1)] if grid.shape[1] > 1 else grid
        if stage_ok is not None:
            grid = grid[[i for i, b in enumerate(grid) if _layout_ok(stage_ok, b, n, pp)]]
        if len(grid) == 0:
            raise PartitionError(
                f"partition search: no interleaved layout within radius {radius} of the anchor passes the stage check"
            )
        best = grid[_lex_best(_keys(w, send, grid, pp), order)]
        return bounds_to_counts(best, n), len(grid)
    if not _layout_ok(stage_ok, anchor, n, pp):
        raise PartitionError("partition search: the anchor layout fails the stage check and the window is too "
                             f"large to enumerate ({n_cand} candidates > max_candidates={max_candidates})")
    best = _coordinate_descent(w, send, anchor, pp, order, windows, stage_ok)
    return bounds_to_counts(best, n), n_cand


def optimal_counts(
    w: np.ndarray, send: np.ndarray, pp: int, vpp: int = 1, stage_ok: StageOk | None = None,
    start: Sequence[Sequence[int]] = (),
) -> tuple[tuple[int, ...], bool]:
    """Smallest slowest-stage time, then variance, then communication. Returns (counts, exact).

    Without virtual stages: exact dynamic programming. With them: coordinate descent from the
    anchor, from the split with the smallest slowest chunk and from each of ``start`` (chunk
    counts), best kept (not proven optimal).
    """
    n = len(w)
    k_parts = _check_split(n, pp, vpp)
    if vpp == 1:
        best = _min_bottleneck(w, k_parts, stage_ok)
        if not np.isfinite(best):
            raise PartitionError(f"optimal partition: no split into {pp} stages passes the stage check")
        counts = _lex_dp(w, send, k_parts, None, best, stage_ok)
        assert counts is not None
        return counts, True
    order = (0, 1, 2)
    # starts: the anchor, the split with the smallest slowest CHUNK (exact DP), and the caller's
    chunk_best = _lex_dp(w, send, k_parts, None, _min_bottleneck(w, k_parts, None), None)
    starts = [anchor_bounds(w, k_parts), counts_to_bounds(chunk_best)] + [counts_to_bounds(c) for c in start]
    results = []
    for b in starts:
        if _layout_ok(stage_ok, b, n, pp):
            results.append(_coordinate_descent(w, send, b, pp, order, None, stage_ok))
    if not results:
        raise PartitionError("optimal partition: no interleaved starting layout passes the stage check")
    keys = _keys(w, send, np.array(results), pp)
    return bounds_to_counts(results[_lex_best(keys, order)], n), False


def param_counts_split(params: np.ndarray, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Split balancing parameter counts (exact min-max without virtual stages; anchor with them)."""
    n = len(params)
    k_parts = _check_split(n, pp, vpp)
    if vpp == 1:
        zeros = np.zeros(n)
        return _lex_dp(params.astype(float), zeros, k_parts, None, _min_bottleneck(params.astype(float), k_parts, None), None)
    return bounds_to_counts(anchor_bounds(params.astype(float), k_parts), n)


# ----------------------------------------------------------------------------------------------
# Planners on cost tables
# ----------------------------------------------------------------------------------------------
def search_partition(
    costs: CostTable, pp: int, *, vpp: int = 1, radius: int = 2, recompute=None,
    stage_ok: StageOk | None = None, max_candidates: int = 200_000,
) -> PartitionReport:
    """The paper's search (anchor + all boundary shifts within ``radius`` units)."""
    t0 = time.perf_counter()
    w, send, act = unit_arrays(costs, recompute)
    counts, n_cand = search_counts(w, send, pp, vpp, radius, stage_ok, max_candidates)
    dt = time.perf_counter() - t0
    return evaluate_counts(w, send, act, counts, pp, "searched", dt, _units_of(costs), candidates=n_cand)


def optimal_partition(
    costs: CostTable, pp: int, *, vpp: int = 1, recompute=None, stage_ok: StageOk | None = None,
    start: Sequence[Sequence[int]] = (),
) -> PartitionReport:
    """The exact minimum slowest-stage time (tie-break variance, communication); see module docstring."""
    t0 = time.perf_counter()
    w, send, act = unit_arrays(costs, recompute)
    counts, exact = optimal_counts(w, send, pp, vpp, stage_ok, start)
    dt = time.perf_counter() - t0
    report = evaluate_counts(w, send, act, counts, pp, "optimal", dt, _units_of(costs), exact=exact)
    return report.with_gap(report.bottleneck_s)


def param_split(costs: CostTable, pp: int, *, vpp: int = 1, recompute=None) -> PartitionReport:
    t0 = time.perf_counter()
    w, send, act = unit_arrays(costs, recompute)
    counts = param_counts_split(np.asarray([u.param_count for u in costs.units], float), pp, vpp)
    return evaluate_counts(w, send, act, counts, pp, "param_split", time.perf_counter() - t0, _units_of(costs))


def default_partition(spec: ModelSpec, costs: CostTable, pp: int, *, vpp: int = 1, recompute=None) -> PartitionReport:
    """Megatron's layout: ``layout.default_layout`` over ``pp * vpp`` chunks."""
    w, send, act = unit_arrays(costs, recompute)
    layout = default_layout(spec, pp * vpp)
    if sum(layout.stage_units) != len(w):
        raise PartitionError(f"cost table has {len(w)} units but model {spec.name!r} has {sum(layout.stage_units)}")
    return evaluate_counts(w, send, act, layout.stage_units, pp, "default", 0.0, _units_of(costs))


def plan_partitions(
    spec: ModelSpec, costs: CostTable, pp: int, *, vpp: int = 1, radius: int = 2, recompute=None,
    stage_ok: StageOk | None = None,
) -> dict[str, PartitionReport]:
    """All four planners, each with its gap to the optimum filled in."""
    reports = {
        "default": default_partition(spec, costs, pp, vpp=vpp, recompute=recompute),
        "param_split": param_split(costs, pp, vpp=vpp, recompute=recompute),
        "searched": search_partition(costs, pp, vpp=vpp, radius=radius, recompute=recompute, stage_ok=stage_ok),
    }
    starts = [r.layout.stage_units for r in reports.values()]
    reports["optimal"] = optimal_partition(costs, pp, vpp=vpp, recompute=recompute, stage_ok=stage_ok, start=starts)
    best = reports["optimal"].bottleneck_s
    if not reports["optimal"].exact:  # the heuristic optimum may lose to another planner
        best = min(best, *(r.bottleneck_s for r in reports.values()))
    return {name: r.with_gap(best) for name, r in reports.items()}
