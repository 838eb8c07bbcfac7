"""Automatic ISF threshold search, and the whole data-level plan (search -> ISF -> step assembly).

Given per-sample tiles and tokens, the data-parallel size N and either a target number of samples
per group K or a maximum sequence length, the search picks Qt, Qv, Q't, Q'v and T.  Candidates run
on a random subset (thresholds are per-group quantities, so a subset of ~10^5 samples ranks them
as the full set would), each is grouped by ISF and assembled into balanced steps, and scored::

    score = dist_ratio_llm + dist_ratio_vit + 4 * max(0, min_fill - fill_llm)
            + 0.05 * (1 - fill_vit) + 0.02 * |samples_per_group - K| / K

Stage 1 tries a grid of token caps and tile caps, stage 2 the lower bounds around the best, stage 3
the pass count T.  The search stops at ``max_candidates`` or after ``time_budget_s`` seconds
(at least one candidate always runs) and reports every candidate it tried with its metrics.

Context parallelism: the trainer pads every sample to a multiple of 2 x CP tokens (2 x CP x TP with sequence
parallelism; ``cp_split.cp_multiple``) and each CP rank runs 1 / CP of the padded tokens, so with
``SearchConfig.token_multiple`` set to that multiple the search and the grouping count every sample's padded tokens:
Qt caps, and the step assembly balances, CP x the per-rank tokens of a micro-batch.  At 1 (the default, no CP) the
real tokens are counted, unchanged.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import UserError
from .assign import DEFAULT_KEYS, StepAssembly, assemble_steps
from .isf import Grouping, ISFParams, isf_group, isf_multi
from .metrics import evaluate_steps
from .sampler import epoch_stream


@dataclass
class SearchConfig:
    """What the search aims at.

    dp_size: data-parallel ranks N; samples_per_group: target K (or None with max_seq_len);
    max_seq_len: fixed token cap Qt (tokens) instead of deriving it from K; vit_cap: most ViT tiles
    a group may hold (None: no limit beyond the data); sp: sequence-parallel packs per rank;
    min_fill: token fill the search must reach; iters: default pass count T; max_candidates and
    time_budget_s (CPU seconds of this process) bound the search: the candidate count binds normally,
    so the result is deterministic for a seed, the time budget is a safety net on slow machines;
    search_samples: subset size the candidates run on;
    oversize: policy for samples over the caps; seed: seeds the subset and ISF;
    token_multiple: every sample's tokens are counted rounded up to a multiple of it (context parallelism: what the
    trainer pads a sample to, ``cp_split.cp_multiple``; see the module docstring), 1: the real tokens.
    """

    dp_size: int = 8
    samples_per_group: float | None = 4.0
    max_seq_len: int | None = None
    vit_cap: int | None = None
    sp: int = 1
    min_fill: float = 0.95
    iters: int = 20
    max_candidates: int = 20
    time_budget_s: float = 3.0
    search_samples: int = 40_000
    oversize: str = "error"
    seed: int = 0
    token_multiple: int = 1

    def __post_init__(self) -> None:
        if self.samples_per_group is None and self.max_seq_len is None:
            raise UserError("SearchConfig: give samples_per_group (K) or max_seq_len")
        if self.samples_per_group is not None and self.samples_per_group <= 0:
            raise UserError(f"SearchConfig: samples_per_group must be > 0, got {self.samples_per_group}")
        if self.dp_size < 1 or self.sp < 1:
            raise UserError(f"SearchConfig: dp_size and sp must be >= 1, got {self.dp_size}, {self.sp}")
        if self.token_multiple < 1:
            raise UserError(f"SearchConfig: token_multiple must be >= 1, got {self.token_multiple}")

    def counted_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """The token counts ISF groups by: each sample rounded up to a multiple of ``token_multiple`` (int64;
        ``tokens`` itself at 1)."""
        m = self.token_multiple
        return -(-tokens // m) * m if m > 1 else tokens


@dataclass
class SearchResult:
    params: ISFParams
    best: dict  # the winning candidate (params, metrics, score)
    candidates: list[dict] = field(default_factory=list)  # every candidate tried, in order
    seconds: float = 0.0  # wall time of the search
    search_samples: int = 0  # samples the candidates ran on

    def to_dict(self) -> dict:
        return {"params": self.params.to_dict(), "best": self.best, "candidates": self.candidates,
                "seconds": self.seconds, "search_samples": self.search_samples}


def step_matrix_epoch0(num_groups: int, width: int, order: np.ndarray | None, seed: int) -> np.ndarray:
    """(full steps, width) group ids of the first epoch as the sampler serves it."""
    stream = epoch_stream(num_groups, width, 0, seed, order)
    s = num_groups // width
    return stream[: s * width].reshape(s, width)


def evaluate_grouping(g: Grouping, dp_size: int, sp: int = 1, qt: float | None = None,
                      qv: float | None = None, seed: int = 0,
                      assembly: StepAssembly | None = None, keys=DEFAULT_KEYS) -> tuple[dict, StepAssembly]:
    """Metrics of ISF groups after balanced step assembly (packed groups: padding 0)."""
    if assembly is None:
        assembly = assemble_steps(g.tokens, g.tiles, dp_size, sp, keys=keys)
    steps = step_matrix_epoch0(len(g), assembly.width, assembly.order, seed)
    m = evaluate_steps(steps, g.tokens, g.tiles, g.sizes, None, qt, qv)
    return m, assembly


def random_group_totals(vit, tokens, k: int, seed: int = 0):
    """Random batching of ``k`` samples per group: (tokens, tiles, longest sample, sizes) per group."""
    vit = np.asarray(vit, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(vit)
    k = max(1, int(round(k)))
    perm = np.random.default_rng(seed).permutation(n)
    offsets = np.append(np.arange(0, n, k), n).astype(np.int64)
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    starts = offsets[:-1]
    return (np.add.reduceat(tokens[perm], starts), np.add.reduceat(vit[perm], starts),
            np.maximum.reduceat(tokens[perm], starts), np.diff(offsets))


def random_baseline(vit, tokens, dp_size: int, k: int, seed: int = 0) -> dict:
    """Metrics of random batching: ``k`` random samples per device, padded to the longest.

    Fill is measured against the largest batch seen (the capacity such batching must provision).
    """
    gt, gv, gm, sizes = random_group_totals(vit, tokens, k, seed)
    steps = step_matrix_epoch0(len(gt), dp_size, None, seed)
    return evaluate_steps(steps, gt, gv, sizes, gm)


def _score(m: dict, cfg: SearchConfig) -> float:
    s = m["dist_ratio_llm"] + m["dist_ratio_vit"] + 4.0 * max(0.0, cfg.min_fill - m["fill_llm"])
    s += 0.05 * (1.0 - min(1.0, m["fill_vit"]))
    if cfg.samples_per_group:
        s += 0.02 * abs(m["samples_per_group"] - cfg.samples_per_group) / cfg.samples_per_group
    return s


def search_params(vit, tokens, cfg: SearchConfig) -> SearchResult:
    """Choose ISF thresholds for these samples (see the module docstring)."""
    t0 = time.perf_counter()
    c_start = time.process_time()
    vit = np.asarray(vit, dtype=np.int64)
    tokens = cfg.counted_tokens(np.asarray(tokens, dtype=np.int64))
    n = len(vit)
    if n == 0:
        raise ValueError("search_params: no samples")
    rng = np.random.default_rng(cfg.seed)
    if n > cfg.search_samples:
        sub = np.sort(rng.choice(n, size=cfg.search_samples, replace=False))
        sv, st = vit[sub], tokens[sub]
    else:
        sv, st = vit, tokens
    mean_t, mean_v = float(st.mean()), float(sv.mean())
    max_t, max_v = int(tokens.max()), int(vit.max())
    strict = cfg.oversize == "error"

    # ---- token caps
    if cfg.max_seq_len is not None:
        qt_grid = [int(cfg.max_seq_len)]
    else:
        base = cfg.samples_per_group * mean_t / 0.965  # expected fill of kept groups
        qt_grid = sorted({int(round(base * f)) for f in (0.97, 1.0, 1.04)})
        if strict:
            qt_grid = sorted({max(q, max_t) for q in qt_grid})
    # ---- tile caps: proportional to the token cap at the data's tiles-per-token ratio
    def qv_grid_for(qt: int) -> list[int]:
        rho = mean_v / max(mean_t, 1.0)
        cands = {int(math.ceil(qt * rho * f)) for f in (1.0, 1.2, 1.6)}
        out = set()
        for q in cands:
            if strict:
                q = max(q, max_v)
            if cfg.vit_cap is not None:
                q = min(q, cfg.vit_cap)
            out.add(max(q, 0))
        return sorted(out)

    candidates: list[dict] = []
    seen: set = set()
    best: dict | None = None

    def run(p: ISFParams) -> None:
        nonlocal best
        key = (p.qv, p.qt, p.qv_min, p.qt_min, p.iters)
        if key in seen:
            return
        seen.add(key)
        c0 = time.perf_counter()
        g = isf_group(sv, st, p, seed=cfg.seed)
        m, asm = evaluate_grouping(g, cfg.dp_size, cfg.sp, p.qt, p.qv, seed=cfg.seed)
        rec = {"params": p.to_dict(), **m, "leftover_groups": g.report["leftover_groups"],
               "groups": len(g), "passes": g.report["passes"], "assembly_key": list(asm.key),
               "seconds": time.perf_counter() - c0}
        rec["score"] = _score(m, cfg)
        candidates.append(rec)
        if best is None or rec["score"] < best["score"]:
            best = rec

    def budget_left() -> bool:
        return len(candidates) < cfg.max_candidates and time.process_time() - c_start < cfg.time_budget_s

    def params(qv, qt, a, b, iters=cfg.iters) -> ISFParams:
        return ISFParams(qv=qv, qt=qt, qv_min=min(qv, int(math.ceil(b * qv))), qt_min=int(math.ceil(a * qt)),
                         iters=iters, oversize=cfg.oversize)

    # stage 1: caps (the middle token cap first, so a tight budget still gets a sensible point)
    mid = qt_grid[len(qt_grid) // 2]
    stage1 = [(qv, qt) for qt in [mid] + [q for q in qt_grid if q != mid] for qv in qv_grid_for(qt)]
    for qv, qt in stage1:
        if candidates and not budget_left():
            break
        run(params(qv, qt, 0.96, 1.0))
    # stage 2: lower bounds around the best caps
    bq = best["params"]
    for a in (0.94, 0.95, 0.97, 0.98):
        for b in (1.0, 0.85):
            if not budget_left():
                break
            run(params(bq["qv"], bq["qt"], a, b))
    # stage 3: pass count
    bq = best["params"]
    for iters in (max(1, cfg.iters // 2), cfg.iters * 2):
        if not budget_left():
            break
        run(ISFParams(bq["qv"], bq["qt"], bq["qv_min"], bq["qt_min"], iters, cfg.oversize))
    bp = best["params"]
    return SearchResult(ISFParams(**bp), best, candidates, time.perf_counter() - t0, len(sv))


@dataclass
class DataPlan:
    """Result of the whole data level: thresholds, groups, balanced order, metrics."""

    params: ISFParams | dict  # ISFParams, or {source id: ISFParams} in multi-group mode
    grouping: Grouping
    assembly: StepAssembly
    metrics: dict
    search: SearchResult | dict | None
    seconds_group: float  # ISF grouping + assembly of all samples, seconds
    seconds_search: float  # threshold search, seconds


def plan_isf(vit, tokens, cfg: SearchConfig, params: ISFParams | None = None) -> DataPlan:
    """Search thresholds (unless ``params`` is given), group all samples and assemble steps (on
    ``cfg.counted_tokens``: with a ``token_multiple`` the grouping's tokens are padded totals)."""
    vit = np.asarray(vit, dtype=np.int64)
    tokens = cfg.counted_tokens(np.asarray(tokens, dtype=np.int64))
    search = None
    t_search = 0.0
    keys = DEFAULT_KEYS
    if params is None:
        search = search_params(vit, tokens, cfg)
        params, t_search = search.params, search.seconds
        keys = [tuple(search.best["assembly_key"]), ("tiles", 0.0)]  # the key the search found best
    t0 = time.perf_counter()
    g = isf_group(vit, tokens, params, seed=cfg.seed)
    m, asm = evaluate_grouping(g, cfg.dp_size, cfg.sp, params.qt, params.qv, seed=cfg.seed, keys=keys)
    return DataPlan(params, g, asm, m, search, time.perf_counter() - t0, t_search)


def plan_isf_multi(vit, tokens, source, cfg: SearchConfig,
                   params_by_source: dict[int, ISFParams] | None = None) -> DataPlan:
    """Multi-group mode: thresholds per dataset group (searched per group unless given), ISF per
    group, one merged group list assembled into balanced steps across groups (on ``cfg.counted_tokens``)."""
    vit = np.asarray(vit, dtype=np.int64)
    tokens = cfg.counted_tokens(np.asarray(tokens, dtype=np.int64))
    source = np.asarray(source)
    t_search = 0.0
    searches = {}
    if params_by_source is None:
        params_by_source = {}
        for s in np.unique(source).tolist():
            idx = source == s
            r = search_params(vit[idx], tokens[idx], cfg)
            params_by_source[s], searches[s] = r.params, r.to_dict()
            t_search += r.seconds
    t0 = time.perf_counter()
    g = isf_multi(vit, tokens, source, params_by_source, seed=cfg.seed)
    # fill per group against its own caps, averaged over groups
    caps_t = np.array([params_by_source[s].qt for s in sorted(params_by_source)], dtype=np.float64)
    caps_v = np.array([params_by_source[s].qv for s in sorted(params_by_source)], dtype=np.float64)
    src_of_group = source[g.members[g.offsets[:-1]]] if len(g) else np.zeros(0, dtype=source.dtype)
    pos = np.searchsorted(np.array(sorted(params_by_source)), src_of_group)
    m, asm = evaluate_grouping(g, cfg.dp_size, cfg.sp, None, None, seed=cfg.seed)
    if len(g):
        m["fill_llm"] = float((g.tokens / caps_t[pos]).mean())
        m["fill_vit"] = float(np.where(caps_v[pos] > 0, g.tiles / np.maximum(caps_v[pos], 1), 0).mean())
    return DataPlan(params_by_source, g, asm, m, searches, time.perf_counter() - t0, t_search)


def params_summary(params: ISFParams | dict) -> dict:
    """The ``params`` block of the CLI JSON: qv, qt, qv_min, qt_min, iters (per group in multi mode)."""
    if isinstance(params, ISFParams):
        return asdict(params)
    per = {str(k): asdict(v) for k, v in params.items()}
    first = next(iter(params.values()))
    return {**{k: v for k, v in asdict(first).items()}, "per_group": per}
