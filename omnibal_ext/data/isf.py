"""ISF: Iterative Sampling and Filtering (OmniBal, ICML 2025), our own vectorised implementation.

Sampling: walk a random permutation of the pool and add samples to the current group until its
tile count would exceed ``qv`` or its token count would exceed ``qt``; then start a new group.
Filtering: keep the groups that reach ``qv_min`` tiles or ``qt_min`` tokens; the samples of the
others return to the pool, which is sampled again.  At most ``iters`` sampling passes; the pass
that keeps nothing, or the last one, ends the loop and its unkept groups stay as "leftover"
groups: every sample ends in exactly one group, none is dropped or duplicated.

Samples larger than a cap follow ``oversize``: ``"error"`` (raise, naming how many and which),
``"solo"`` (each becomes its own group) or ``"truncate"`` (its tokens are cut to ``qt`` and its
tiles to ``qv``; the trainer must apply the same cut, the pack file lists these samples).

ISF in time (native resolution): with per-sample predicted times (``times``: ViT-side and LLM-side, integer
units, ``model/sample_time.py``) and time caps in the params (``vit_time``, ``llm_time``), a group also closes
before its ViT or LLM time would exceed its cap, and the filter keeps the groups that reach ``vit_time_min`` or
``llm_time_min`` instead of the count bounds: the counts (tiles or patches, tokens) stay hard caps (memory is
planned for them), the balance is in time.

The greedy pass is vectorised: with prefix sums ``C`` of tokens (tiles) along the walk, the end of
the group starting at position ``s`` is ``searchsorted(C, C[s] + cap, 'right') - 1`` for every ``s``
at once; only the chain of group starts (one step per group, not per sample) is followed in Python.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import UserError

OVERSIZE_POLICIES = ("error", "solo", "truncate")

KIND_KEPT = 0  # reached a lower bound in some pass
KIND_LEFTOVER = 1  # still short of both lower bounds when the passes ended
KIND_SOLO = 2  # one oversize sample on its own (oversize="solo")
KIND_NAMES = {KIND_KEPT: "kept", KIND_LEFTOVER: "leftover", KIND_SOLO: "solo"}


class OversizeError(UserError):
    """Samples larger than the group caps under ``oversize="error"``."""


@dataclass(frozen=True)
class ISFParams:
    """Thresholds of one ISF run.

    qv: ViT cap per group (Qv, in the family's ViT items: tiles, or patches at native resolution);
    qt: token cap per group (Qt, LLM tokens);
    qv_min / qt_min: lower bounds (Q'v, Q't) a group must reach (either one) to be kept;
    iters: sampling passes at most (T); oversize: policy for samples over a cap.
    ISF in time (all None/0 otherwise): vit_time / llm_time: caps on a group's predicted ViT and LLM time
    (integer time units of the ``times`` given to ``isf_group``); vit_time_min / llm_time_min: the lower bounds
    that then replace qv_min / qt_min in the filter.
    """

    qv: int
    qt: int
    qv_min: int
    qt_min: int
    iters: int = 10
    oversize: str = "error"
    vit_time: int | None = None
    llm_time: int | None = None
    vit_time_min: int = 0
    llm_time_min: int = 0

    def __post_init__(self) -> None:
        if self.qt <= 0 or self.qv < 0:
            raise UserError(f"ISFParams: qt must be > 0 and qv >= 0, got qt={self.qt}, qv={self.qv}")
        if not (0 <= self.qt_min <= self.qt) or not (0 <= self.qv_min <= self.qv):
            raise UserError(
                f"ISFParams: need 0 <= qt_min <= qt and 0 <= qv_min <= qv, got qt_min={self.qt_min}, "
                f"qt={self.qt}, qv_min={self.qv_min}, qv={self.qv}")
        if self.iters < 1:
            raise UserError(f"ISFParams: iters must be >= 1, got {self.iters}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise UserError(f"ISFParams: oversize must be one of {OVERSIZE_POLICIES}, got {self.oversize!r}")
        if (self.vit_time is None) != (self.llm_time is None):
            raise UserError("ISFParams: vit_time and llm_time go together")
        if self.timed:
            if not (0 <= self.vit_time_min <= self.vit_time and 0 <= self.llm_time_min <= self.llm_time):
                raise UserError(f"ISFParams: need 0 <= vit_time_min <= vit_time and 0 <= llm_time_min <= llm_time, "
                                f"got {self.vit_time_min}, {self.vit_time}, {self.llm_time_min}, {self.llm_time}")
            if self.oversize == "truncate":
                raise UserError("ISFParams: oversize='truncate' cuts counts, not time; use 'error' or 'solo' in time")

    @property
    def timed(self) -> bool:
        """Whether the groups are balanced in predicted time (time caps given)."""
        return self.vit_time is not None

    def to_dict(self) -> dict:
        """The fields; the time ones only when set (so count-based params keep their old form)."""
        d = asdict(self)
        if not self.timed:
            for k in ("vit_time", "llm_time", "vit_time_min", "llm_time_min"):
                del d[k]
        return d


@dataclass
class Grouping:
    """Groups of samples in CSR form.

    members: int64, sample indices group after group; offsets: int64 (G+1,), group g holds
    ``members[offsets[g]:offsets[g+1]]``; tokens/tiles: int64 (G,) totals per group (after
    truncation); max_tokens: int64 (G,) longest sample per group; kind: int8 (G,), KIND_*;
    truncated: (k, 3) int64 rows [sample, tokens_after, tiles_after] of truncated samples;
    report: counts and timings (see ``isf_group``); vit_time/llm_time: int64 (G,) predicted time per group
    when grouped in time (``times``), else None.
    """

    members: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray
    tiles: np.ndarray
    max_tokens: np.ndarray
    kind: np.ndarray
    truncated: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    report: dict = field(default_factory=dict)
    vit_time: np.ndarray | None = None
    llm_time: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def group(self, g: int) -> np.ndarray:
        return self.members[self.offsets[g]:self.offsets[g + 1]]

    def groups(self) -> list[np.ndarray]:
        """Sample indices per group (views into ``members``)."""
        if len(self) == 0:
            return []
        return np.split(self.members, self.offsets[1:-1])


def _empty_grouping() -> Grouping:
    z = np.zeros(0, dtype=np.int64)
    return Grouping(z, np.zeros(1, dtype=np.int64), z, z, z, np.zeros(0, dtype=np.int8))


def _finish(members, offsets, tok, vit, kind, truncated=None, report=None) -> Grouping:
    if len(offsets) > 1:
        starts = offsets[:-1]
        gt = np.add.reduceat(tok[members], starts)
        gv = np.add.reduceat(vit[members], starts)
        gm = np.maximum.reduceat(tok[members], starts)
    else:
        gt = gv = gm = np.zeros(0, dtype=np.int64)
    return Grouping(members, offsets, gt, gv, gm, kind,
                    truncated if truncated is not None else np.zeros((0, 3), dtype=np.int64),
                    report or {})


def group_sums(values: np.ndarray, members: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-group sums of per-sample ``values`` (int64) for groups in CSR form."""
    if len(offsets) < 2:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(np.asarray(values, dtype=np.int64)[members], offsets[:-1])


def greedy_starts(tokens: np.ndarray, tiles: np.ndarray, qt: int, qv: int, extra=()) -> np.ndarray:
    """Group boundaries of one greedy pass over samples in walk order.

    Returns int64 positions ``b`` with b[0] = 0 and b[-1] = n; group j holds walk positions
    b[j]..b[j+1]-1.  Every sample must fit the caps on its own (tokens <= qt, tiles <= qv).
    extra: more (per-sample values in walk order, cap) pairs a group must also stay within (ISF in time).

    ``nxt[s]`` (where a group opened at ``s`` ends) comes from prefix sums and searchsorted for all
    ``s`` at once; the chain 0, nxt[0], nxt[nxt[0]], ... is then read by pointer doubling: with
    ``J = nxt`` composed with itself k times, the first 2^k chain nodes map to the next 2^k.
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    ct = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(tokens, out=ct[1:])
    cv = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(tiles, out=cv[1:])
    start = np.arange(n)
    nxt = np.searchsorted(ct, ct[:-1] + qt, side="right") - 1
    # the tile cap only matters where the token-limited group holds too many tiles
    over = np.flatnonzero(cv[nxt] - cv[:-1] > qv)
    if len(over):
        nxt[over] = np.searchsorted(cv, cv[over] + qv, side="right") - 1
    for values, cap in extra:  # each further cap can only end a group earlier
        cx = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(values, out=cx[1:])
        over = np.flatnonzero(cx[nxt] - cx[:-1] > cap)
        if len(over):
            nxt[over] = np.searchsorted(cx, cx[over] + cap, side="right") - 1
    if np.any(nxt <= start):
        raise ValueError("greedy_starts: a sample exceeds the caps on its own")
    jump = np.append(nxt, n)  # position n maps to itself
    chain = np.zeros(1, dtype=np.int64)
    while True:
        ext = jump[chain]
        if ext[-1] >= n:
            chain = np.concatenate([chain, ext[ext < n]])
            break
        chain = np.concatenate([chain, ext])
        jump = jump[jump]
    return np.append(chain, n)


def _oversize_mask(tok: np.ndarray, vit: np.ndarray, p: ISFParams, times=None) -> np.ndarray:
    over = (tok > p.qt) | (vit > p.qv)
    if times is not None:
        over |= (times[0] > p.vit_time) | (times[1] > p.llm_time)
    return over


def isf_group(vit, tokens, params: ISFParams, seed: int = 0, sample_ids: np.ndarray | None = None,
              shard_size: int = 1 << 16, times: tuple[np.ndarray, np.ndarray] | None = None) -> Grouping:
    """Run ISF over samples with ``vit`` tiles and ``tokens`` tokens each.

    sample_ids: the indices to put in the groups (default ``arange(n)``), so a subset can be
    grouped with its global indices.  shard_size: pools larger than this many samples are split at
    random into shards grouped independently (the result is still one partition).  Deterministic
    for a seed.  The report holds: samples_in, samples_out, groups, kept_groups, leftover_groups,
    leftover_samples, solo_groups, truncated_samples, passes, shards, seconds.
    times: (ViT, LLM) predicted time of each sample in integer units, required by (and only used with) params
    that have time caps (ISF in time, module docstring); the result then carries per-group times.
    """
    t0 = time.perf_counter()
    vit = np.asarray(vit, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.int64).copy()
    n = len(vit)
    ids = np.arange(n, dtype=np.int64) if sample_ids is None else np.asarray(sample_ids, dtype=np.int64)
    if ids.shape != (n,) or tok.shape != (n,):
        raise ValueError(f"isf_group: vit, tokens and sample_ids must have one length, got "
                         f"{vit.shape}, {tok.shape}, {ids.shape}")
    vit = vit.copy()
    p = params
    if p.timed != (times is not None):
        raise ValueError("isf_group: params with time caps need times, and times need params with time caps")
    if times is not None:
        times = tuple(np.asarray(t, dtype=np.int64) for t in times)
        if any(t.shape != (n,) for t in times):
            raise ValueError(f"isf_group: times must be two arrays of {n} samples")
    over = _oversize_mask(tok, vit, p, times)
    n_over = int(over.sum())
    truncated = np.zeros((0, 3), dtype=np.int64)
    solo = np.zeros(0, dtype=np.int64)
    if n_over:
        bad = ids[over]
        if p.oversize == "error":
            shown = ", ".join(str(i) for i in bad[:20].tolist()) + (", ..." if n_over > 20 else "")
            caps = f"qt={p.qt} tokens, qv={p.qv} ViT items" + (
                f", vit_time={p.vit_time}, llm_time={p.llm_time}" if p.timed else "")
            raise OversizeError(
                f"{n_over} sample(s) exceed the group caps ({caps}): sample "
                f"indices [{shown}]; raise the caps or choose oversize='solo' or 'truncate'")
        if p.oversize == "truncate":
            np.minimum(tok, p.qt, out=tok)
            np.minimum(vit, p.qv, out=vit)
            truncated = np.stack([bad, tok[over], vit[over]], axis=1)
        else:  # solo
            solo = np.flatnonzero(over)
    # local positions 0..n-1 are grouped; ids maps them to sample indices at the end.  Large pools
    # run as independent shards of a random split (same statistics, cache-sized arrays: faster).
    rng = np.random.default_rng(seed)
    pool = np.flatnonzero(~over) if len(solo) else np.arange(n, dtype=np.int64)
    n_shards = max(1, -(-len(pool) // max(1, shard_size)))
    if n_shards > 1:
        pool = pool[rng.permutation(len(pool))]
    kept_m, kept_s, left_m, left_s = [], [], [], []
    passes = 0
    for shard in np.array_split(pool, n_shards):
        shard_times = None if times is None else (times[0][shard], times[1][shard])
        km, ks, lm, ls, n_pass = _isf_passes(tok[shard], vit[shard], p, rng, shard_times)
        kept_m.append(shard[km])
        kept_s.append(ks)
        left_m.append(shard[lm])
        left_s.append(ls)
        passes = max(passes, n_pass)
    members = np.concatenate(kept_m + left_m + [solo])
    sizes = np.concatenate(kept_s + left_s + [np.ones(len(solo), dtype=np.int64)])
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    n_kept = int(sum(len(s) for s in kept_s))
    n_left = int(sum(len(s) for s in left_s))
    kind = np.concatenate([np.full(n_kept, KIND_KEPT, np.int8), np.full(n_left, KIND_LEFTOVER, np.int8),
                           np.full(len(solo), KIND_SOLO, np.int8)])
    g = _finish(members, offsets, tok, vit, kind, truncated)
    if times is not None:
        g.vit_time, g.llm_time = (group_sums(t, g.members, g.offsets) for t in times)
    g.members = ids[g.members]
    g.report = {
        "samples_in": n,
        "samples_out": int(len(g.members)),
        "groups": len(g),
        "kept_groups": n_kept,
        "leftover_groups": n_left,
        "leftover_samples": int(sum(int(s.sum()) for s in left_s)),
        "solo_groups": int(len(solo)),
        "truncated_samples": int(len(truncated)),
        "passes": passes,
        "shards": n_shards,
        "seconds": time.perf_counter() - t0,
    }
    return g


def _isf_passes(tok: np.ndarray, vit: np.ndarray, p: ISFParams, rng: np.random.Generator, times=None):
    """Sampling and filtering passes over samples ``0..len(tok)-1`` (``times``: ISF in time).

    Returns (kept members, kept group sizes, leftover members, leftover group sizes, passes run);
    members are local positions, group after group.
    """
    pool = np.arange(len(tok), dtype=np.int64)
    kept_m, kept_s = [], []
    passes = 0
    left_m = left_s = np.zeros(0, dtype=np.int64)
    while len(pool):
        passes += 1
        walk = pool[rng.permutation(len(pool))]
        tw, vw = tok[walk], vit[walk]
        if times is None:
            b = greedy_starts(tw, vw, p.qt, p.qv)
            keep = (np.add.reduceat(tw, b[:-1]) >= p.qt_min) | (np.add.reduceat(vw, b[:-1]) >= p.qv_min)
        else:
            vt, lt = times[0][walk], times[1][walk]
            b = greedy_starts(tw, vw, p.qt, p.qv, extra=((vt, p.vit_time), (lt, p.llm_time)))
            keep = (np.add.reduceat(lt, b[:-1]) >= p.llm_time_min) | (np.add.reduceat(vt, b[:-1]) >= p.vit_time_min)
        sizes = np.diff(b)
        pos_keep = np.repeat(keep, sizes)
        kept_m.append(walk[pos_keep])
        kept_s.append(sizes[keep])
        if keep.all() or passes >= p.iters or not keep.any():
            left_m, left_s = walk[~pos_keep], sizes[~keep]
            break
        pool = walk[~pos_keep]
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
    return cat(kept_m), cat(kept_s), left_m, left_s, passes


def merge_groupings(parts: list[Grouping]) -> Grouping:
    """Concatenate groupings of disjoint sample sets (members already global indices)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return _empty_grouping()
    members = np.concatenate([p.members for p in parts])
    sizes = np.concatenate([p.sizes for p in parts])
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    report: dict = {}
    for p in parts:
        for k, v in p.report.items():
            if isinstance(v, (int, float)):
                report[k] = max(report.get(k, 0), v) if k == "passes" else report.get(k, 0) + v
    return Grouping(
        members, offsets,
        np.concatenate([p.tokens for p in parts]), np.concatenate([p.tiles for p in parts]),
        np.concatenate([p.max_tokens for p in parts]), np.concatenate([p.kind for p in parts]),
        np.concatenate([p.truncated for p in parts]), report,
        *((np.concatenate([p.vit_time for p in parts]), np.concatenate([p.llm_time for p in parts]))
          if all(p.vit_time is not None for p in parts) else (None, None)),
    )


def isf_multi(vit, tokens, source, params_by_source: dict[int, ISFParams], seed: int = 0) -> Grouping:
    """Multi-group mode: ISF per dataset group with its own thresholds, merged into one group list.

    source: per-sample dataset-group id; params_by_source maps every id present to its ISFParams.
    Sample indices in the result are global (positions in ``vit``/``tokens``).
    """
    vit = np.asarray(vit, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    source = np.asarray(source)
    ids_present = np.unique(source).tolist()
    missing = [s for s in ids_present if s not in params_by_source]
    if missing:
        raise ValueError(f"isf_multi: no ISFParams for dataset group(s) {missing}")
    parts = []
    for k, s in enumerate(ids_present):
        idx = np.flatnonzero(source == s)
        parts.append(isf_group(vit[idx], tokens[idx], params_by_source[s], seed=seed + 1000003 * k,
                               sample_ids=idx))
    out = merge_groupings(parts)
    out.report["dataset_groups"] = len(parts)
    return out


def check_partition(grouping: Grouping, num_samples: int) -> None:
    """Raise AssertionError if some sample of ``range(num_samples)`` is missing or appears twice."""
    counts = np.bincount(grouping.members, minlength=num_samples)
    if len(counts) > num_samples or np.any(counts != 1):
        missing = np.flatnonzero(counts[:num_samples] == 0)
        dup = np.flatnonzero(counts > 1)
        raise AssertionError(
            f"grouping is not a partition of {num_samples} samples: missing {missing[:10].tolist()}, "
            f"duplicated {dup[:10].tolist()}")
