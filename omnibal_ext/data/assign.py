"""Step assembly: which N groups train together in one data-parallel step.

ISF makes every group reach a lower bound in tokens OR in tiles, so two groups can hold the same
tokens and very different tile counts.  The step waits for the slowest rank in both the ViT and the
LLM, so the N groups of one step must be alike in BOTH.  We order the groups by a two-dimensional
key and cut the order into consecutive runs of N:

* primary: one dimension cut into bins (exact values, or geometric bins of relative width ``r``),
* secondary: the other dimension, ascending in even bins and descending in odd ones ("snake"), so
  the run that straddles two bins joins groups that are close in both.

Several keys (tiles first / tokens first, a few bin widths) are tried and the one with the least
``dist_ratio_llm + dist_ratio_vit`` over the resulting steps wins.  With sequence parallelism
(``sp > 1``) a step holds ``dp * sp`` groups, and every consecutive run of ``sp`` packs in the order
is as alike as the whole step.

This module also saves and loads the "pack" file the trainer reads (groups + balanced order).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from .isf import Grouping
from .metrics import dist_ratio_matrix

# (primary dimension, relative bin width; 0 = exact integer values)
DEFAULT_KEYS: tuple[tuple[str, float], ...] = (
    ("tiles", 0.0), ("tiles", 0.02), ("tiles", 0.06), ("tiles", 0.15),
    ("tokens", 0.005), ("tokens", 0.02), ("tokens", 0.06),
)


@dataclass
class StepAssembly:
    """Balanced order of the groups: ``order[i*width:(i+1)*width]`` is step i (the last may be short).

    width: groups per step (dp_size * sp); key: the winning sort key; tried: every key with its
    dist ratios (over full steps).
    """

    order: np.ndarray
    width: int
    key: tuple[str, float] = ("tiles", 0.0)
    tried: list[dict] = field(default_factory=list)

    @property
    def num_full_steps(self) -> int:
        return len(self.order) // self.width

    def step_matrix(self) -> np.ndarray:
        """(full steps, width) group ids."""
        s = self.num_full_steps
        return self.order[: s * self.width].reshape(s, self.width)

    def steps(self) -> list[np.ndarray]:
        """Group ids per step, the short last one included."""
        return [self.order[i:i + self.width] for i in range(0, len(self.order), self.width)]


def _bins(x: np.ndarray, rel: float) -> np.ndarray:
    if rel <= 0:
        return x.astype(np.int64)
    return np.floor(np.log1p(x.astype(np.float64)) / np.log1p(rel)).astype(np.int64)


def sort_order(tokens: np.ndarray, tiles: np.ndarray, primary: str, rel: float) -> np.ndarray:
    """Group ids sorted by (bin of the primary dimension, snake of the secondary)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    tiles = np.asarray(tiles, dtype=np.int64)
    if primary == "tiles":
        p, s = tiles, tokens
    elif primary == "tokens":
        p, s = tokens, tiles
    else:
        raise ValueError(f"sort_order: primary must be 'tiles' or 'tokens', got {primary!r}")
    b = _bins(p, rel)
    if b.size:
        b -= b.min()
    # secondary ascending in even bins, descending in odd ones; ties broken by the primary value
    s_key = np.where(b % 2 == 0, s - s.min(initial=0), s.max(initial=0) - s)
    p_key = np.where(b % 2 == 0, p - p.min(initial=0), p.max(initial=0) - p)
    span_p = int(p_key.max(initial=0)) + 1
    span_s = int(s_key.max(initial=0)) + 1
    if (int(b.max(initial=0)) + 1) * span_s * span_p < 2**62:  # one int64 key: one fast sort
        return np.argsort((b * span_s + s_key) * span_p + p_key, kind="stable").astype(np.int64)
    return np.lexsort((p_key, s_key, b)).astype(np.int64)


def _score(order: np.ndarray, tokens: np.ndarray, tiles: np.ndarray, width: int) -> tuple[float, float]:
    s = len(order) // width
    steps = order[: s * width].reshape(s, width)
    return dist_ratio_matrix(tokens[steps]), dist_ratio_matrix(tiles[steps])


def assemble_steps(tokens, tiles, dp_size: int, sp: int = 1, keys=DEFAULT_KEYS) -> StepAssembly:
    """Balanced step order of groups with per-group ``tokens`` and ``tiles`` totals.

    dp_size: data-parallel ranks; sp: sequence-parallel packs per rank (a step is dp_size*sp groups);
    keys: the (primary dimension, relative bin width) sort keys to try.
    """
    if dp_size < 1 or sp < 1:
        raise ValueError(f"assemble_steps: dp_size and sp must be >= 1, got {dp_size}, {sp}")
    tokens = np.asarray(tokens, dtype=np.int64)
    tiles = np.asarray(tiles, dtype=np.int64)
    width = dp_size * sp
    if len(tokens) == 0:
        return StepAssembly(np.zeros(0, dtype=np.int64), width)
    best = None
    tried = []
    for primary, rel in dict.fromkeys(tuple(k) for k in keys):
        order = sort_order(tokens, tiles, primary, rel)
        d_llm, d_vit = _score(order, tokens, tiles, width)
        tried.append({"primary": primary, "rel_bin": rel, "dist_ratio_llm": d_llm, "dist_ratio_vit": d_vit})
        if best is None or d_llm + d_vit < best[0]:
            best = (d_llm + d_vit, order, (primary, rel))
    return StepAssembly(best[1], width, best[2], tried)


def sp_runs(grouping: Grouping, sp: int) -> np.ndarray:
    """Group order in runs of ``sp`` packs of similar tokens and tiles (the last run may be short).

    Every group appears exactly once; nothing is dropped or duplicated to round the count.
    """
    return assemble_steps(grouping.tokens, grouping.tiles, dp_size=1, sp=sp).order


# ---------------------------------------------------------------------------------------------
# Pack files: what the trainer reads.
# ---------------------------------------------------------------------------------------------
PACK_FORMAT = "omnibal-isf-pack"
PACK_VERSION = 1


@dataclass
class PackPlan:
    """Groups and their balanced order, as written by ``omnibal isf pack``.

    groups: sample indices per group (indices into the concatenated stats files, in file order);
    order: balanced group order (consecutive ``dp_size*sp`` form a step; the sampler shuffles steps);
    group_tokens/group_tiles: per-group totals; truncated: rows [sample, tokens, tiles] to cut;
    meta: files, params, dp_size, sp, seed, report.
    """

    groups: list[np.ndarray]
    order: np.ndarray
    group_tokens: np.ndarray
    group_tiles: np.ndarray
    truncated: np.ndarray
    meta: dict

    @property
    def dp_size(self) -> int:
        return int(self.meta.get("dp_size", 1))

    @property
    def sp(self) -> int:
        return int(self.meta.get("sp", 1))


def make_pack(grouping: Grouping, assembly: StepAssembly, meta: dict) -> PackPlan:
    return PackPlan(grouping.groups(), np.asarray(assembly.order, dtype=np.int64), grouping.tokens,
                    grouping.tiles, grouping.truncated, dict(meta))


def save_pack(plan: PackPlan, path: str | Path) -> None:
    """Write ``plan`` as JSON (``.json``) or numpy archive (``.npz``)."""
    path = Path(path)
    sizes = np.array([len(g) for g in plan.groups], dtype=np.int64)
    members = np.concatenate(plan.groups) if plan.groups else np.zeros(0, dtype=np.int64)
    meta = {"format": PACK_FORMAT, "version": PACK_VERSION, **plan.meta}
    if path.suffix == ".npz":
        np.savez_compressed(path, members=members, sizes=sizes, order=plan.order,
                            group_tokens=plan.group_tokens, group_tiles=plan.group_tiles,
                            truncated=np.asarray(plan.truncated, dtype=np.int64).reshape(-1, 3),
                            meta=np.array(json.dumps(meta)))
        return
    doc = {**meta, "groups": [g.tolist() for g in plan.groups], "order": plan.order.tolist(),
           "group_tokens": plan.group_tokens.tolist(), "group_tiles": plan.group_tiles.tolist(),
           "truncated": np.asarray(plan.truncated).reshape(-1, 3).tolist()}
    with open(path, "w") as f:
        json.dump(doc, f)


def load_pack(path: str | Path) -> PackPlan:
    """Read a pack file written by ``save_pack``; ValueError names the file and the problem."""
    path = Path(path)
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                sizes = z["sizes"]
                members = z["members"]
                groups = np.split(members, np.cumsum(sizes)[:-1]) if len(sizes) else []
                order, gt, gv, tr = z["order"], z["group_tokens"], z["group_tiles"], z["truncated"]
        else:
            with open(path) as f:
                doc = json.load(f)
            groups = [np.asarray(g, dtype=np.int64) for g in doc.pop("groups")]
            order = np.asarray(doc.pop("order"), dtype=np.int64)
            gt = np.asarray(doc.pop("group_tokens"), dtype=np.int64)
            gv = np.asarray(doc.pop("group_tiles"), dtype=np.int64)
            tr = np.asarray(doc.pop("truncated"), dtype=np.int64).reshape(-1, 3)
            meta = doc
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable ISF pack file: {e}") from e
    if meta.get("format") != PACK_FORMAT:
        raise UserError(f"{path}: format is {meta.get('format')!r}, expected {PACK_FORMAT!r}")
    if sorted(np.asarray(order).tolist()) != list(range(len(groups))):
        raise UserError(f"{path}: 'order' is not a permutation of the {len(groups)} groups")
    return PackPlan(groups, np.asarray(order, dtype=np.int64), np.asarray(gt, dtype=np.int64),
                    np.asarray(gv, dtype=np.int64), np.asarray(tr, dtype=np.int64).reshape(-1, 3), meta)
