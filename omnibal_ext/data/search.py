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

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

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


def search_score(m: dict, cfg: SearchConfig, suffix: str = "") -> float:
    """The score of a candidate's metrics ``m`` (module docstring); ``suffix`` picks the balance measured:
    "" counts, "_time" predicted time (``dist_ratio_llm_time``, ...)."""
    s = m["dist_ratio_llm" + suffix] + m["dist_ratio_vit" + suffix]
    s += 4.0 * max(0.0, cfg.min_fill - m["fill_llm" + suffix])
    s += 0.05 * (1.0 - min(1.0, m["fill_vit" + suffix]))
    if cfg.samples_per_group:
        s += 0.02 * abs(m["samples_per_group"] - cfg.samples_per_group) / cfg.samples_per_group
    return s


def search_subset(n: int, cfg: SearchConfig) -> np.ndarray:
    """Sorted indices of the samples the candidates run on: ``cfg.search_samples`` drawn (seeded) when there are
    more, else all ``n``."""
    if n > cfg.search_samples:
        return np.sort(np.random.default_rng(cfg.seed).choice(n, size=cfg.search_samples, replace=False))
    return np.arange(n)


def llm_cap_grid(cfg: SearchConfig, mean: float, largest: int) -> list[int]:
    """Stage-1 caps of the LLM side (tokens, or LLM time): K mean samples at the expected fill of kept groups,
    x 0.97, 1, 1.04; never below the largest sample under ``oversize="error"``.  ``mean``: over the subset."""
    base = cfg.samples_per_group * mean / 0.965  # expected fill of kept groups
    grid = {int(round(base * f)) for f in (0.97, 1.0, 1.04)}
    return sorted({max(c, largest) for c in grid} if cfg.oversize == "error" else grid)


def vit_cap_grid(cfg: SearchConfig, llm_cap: int, mean_vit: float, mean_llm: float, largest: int,
                 limit: int | None = None) -> list[int]:
    """Stage-1 caps of the ViT side (tiles, or ViT time) for one LLM cap: the cap at the data's ViT / LLM ratio,
    x 1, 1.2, 1.6; never below the largest sample under ``oversize="error"``, at most ``limit``."""
    rho = mean_vit / max(mean_llm, 1.0)
    out = set()
    for c in {int(math.ceil(llm_cap * rho * f)) for f in (1.0, 1.2, 1.6)}:
        if cfg.oversize == "error":
            c = max(c, largest)
        if limit is not None:
            c = min(c, limit)
        out.add(max(c, 0))
    return sorted(out)


@dataclass(frozen=True)
class SearchSpace:
    """One instance of the threshold search (``run_search``): what it varies and how it measures a candidate.

    llm_caps: the stage-1 LLM-side caps; vit_caps(llm cap): the ViT-side caps tried with one;
    params(vit cap, llm cap, a, b, iters): the ISFParams of two caps and the lower bounds' fractions a (LLM) and
    b (ViT) of them; caps(params dict): the (ViT, LLM) caps of a candidate's params; evaluate(params): (metrics,
    grouping, step assembly) of the subset grouped with them; suffix: the metrics ``search_score`` reads.
    Counts (``search_params``) and predicted time (``search_time.search_params_time``) are the two instances.
    """

    llm_caps: list[int]
    vit_caps: Callable[[int], list[int]]
    params: Callable[[int, int, float, float, int], ISFParams]
    caps: Callable[[dict], tuple[int, int]]
    evaluate: Callable[[ISFParams], tuple[dict, Grouping, StepAssembly]]
    suffix: str = ""


def run_search(space: SearchSpace, cfg: SearchConfig, search_samples: int) -> SearchResult:
    """Stage 1 tries the caps (the middle LLM cap first, so a tight budget still gets a sensible point), stage 2
    the lower bounds around the best caps, stage 3 the pass count T; each candidate grouped and scored
    (``search_score``); stops at ``cfg.max_candidates`` or ``cfg.time_budget_s`` CPU seconds, after at least one.
    search_samples: the subset's size (reported)."""
    t0 = time.perf_counter()
    c_start = time.process_time()
    candidates: list[dict] = []
    seen: set = set()
    best: dict | None = None

    def run(p: ISFParams) -> None:
        nonlocal best
        if p in seen:
            return
        seen.add(p)
        c0 = time.perf_counter()
        m, g, asm = space.evaluate(p)
        rec = {"params": p.to_dict(), **m, "leftover_groups": g.report["leftover_groups"],
               "groups": len(g), "passes": g.report["passes"], "assembly_key": list(asm.key),
               "seconds": time.perf_counter() - c0}
        rec["score"] = search_score(m, cfg, space.suffix)
        candidates.append(rec)
        if best is None or rec["score"] < best["score"]:
            best = rec

    def budget_left() -> bool:
        return len(candidates) < cfg.max_candidates and time.process_time() - c_start < cfg.time_budget_s

    mid = space.llm_caps[len(space.llm_caps) // 2]
    stage1 = [(v, c) for c in [mid] + [c for c in space.llm_caps if c != mid] for v in space.vit_caps(c)]
    for vcap, lcap in stage1:
        if candidates and not budget_left():
            break
        run(space.params(vcap, lcap, 0.96, 1.0, cfg.iters))
    vcap, lcap = space.caps(best["params"])
    for a in (0.94, 0.95, 0.97, 0.98):
        for b in (1.0, 0.85):
            if not budget_left():
                break
            run(space.params(vcap, lcap, a, b, cfg.iters))
    bp = ISFParams(**best["params"])
    for iters in (max(1, cfg.iters // 2), cfg.iters * 2):
        if not budget_left():
            break
        run(dataclasses.replace(bp, iters=iters))
    return SearchResult(ISFParams(**best["params"]), best, candidates, time.perf_counter() - t0, search_samples)


def search_params(vit, tokens, cfg: SearchConfig) -> SearchResult:
    """Choose ISF thresholds for these samples (see the module docstring)."""
    vit = np.asarray(vit, dtype=np.int64)
    tokens = cfg.counted_tokens(np.asarray(tokens, dtype=np.int64))
    if len(vit) == 0:
        raise ValueError("search_params: no samples")
    sub = search_subset(len(vit), cfg)
    sv, st = vit[sub], tokens[sub]
    mean_t, mean_v = float(st.mean()), float(sv.mean())
    max_t, max_v = int(tokens.max()), int(vit.max())
    qt_grid = [int(cfg.max_seq_len)] if cfg.max_seq_len is not None else llm_cap_grid(cfg, mean_t, max_t)

    def params(qv, qt, a, b, iters) -> ISFParams:
        return ISFParams(qv=qv, qt=qt, qv_min=min(qv, int(math.ceil(b * qv))), qt_min=int(math.ceil(a * qt)),
                         iters=iters, oversize=cfg.oversize)

    def evaluate(p: ISFParams):
        g = isf_group(sv, st, p, seed=cfg.seed)
        m, asm = evaluate_grouping(g, cfg.dp_size, cfg.sp, p.qt, p.qv, seed=cfg.seed)
        return m, g, asm

    space = SearchSpace(qt_grid, lambda qt: vit_cap_grid(cfg, qt, mean_v, mean_t, max_v, cfg.vit_cap), params,
                        lambda p: (p["qv"], p["qt"]), evaluate)
    return run_search(space, cfg, len(sv))


@dataclass
class IsfResult:
    """Result of the whole data level: thresholds, groups, balanced order, metrics."""

    params: ISFParams | dict  # ISFParams, or {source id: ISFParams} in multi-group mode
    grouping: Grouping
    assembly: StepAssembly
    metrics: dict
    search: SearchResult | dict | None
    seconds_group: float  # ISF grouping + assembly of all samples, seconds
    seconds_search: float  # threshold search, seconds


def run_isf(vit, tokens, cfg: SearchConfig, params: ISFParams | None = None) -> IsfResult:
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
    return IsfResult(params, g, asm, m, search, time.perf_counter() - t0, t_search)


def run_isf_by_source(vit, tokens, source, cfg: SearchConfig,
                   params_by_source: dict[int, ISFParams] | None = None) -> IsfResult:
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
    return IsfResult(params_by_source, g, asm, m, searches, time.perf_counter() - t0, t_search)


def params_summary(params: ISFParams | dict) -> dict:
    """The ``params`` block of the CLI JSON: qv, qt, qv_min, qt_min, iters (per group in multi mode)."""
    if isinstance(params, ISFParams):
        return asdict(params)
    per = {str(k): asdict(v) for k, v in params.items()}
    first = next(iter(params.values()))
    return {**{k: v for k, v in asdict(first).items()}, "per_group": per}
