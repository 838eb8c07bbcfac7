"""Native-resolution image sizes for the stats: patch counts at native resolution, and sizes drawn to fit tiles.

numpy only, vectorised over images. Three jobs:

* ``smart_resize``: the size in px an image is resized to before patching, the published rule (both sides multiples
  of ``factor`` = patch x merge = 28 px, the area kept within ``[min_pixels, max_pixels]``, the aspect ratio kept
  as the grid allows); the same arithmetic as the trainer's (a test compares them on many sizes), so
  ``native_patches`` is the patch count the trainer gives an image: ``(h / 14) * (w / 14)`` of the resized size.
* ``patch_grid``: the ``(rows, cols)`` patch grid of an image from its original size and its patch count (the
  factorisation of the count into merge-aligned sides whose aspect is nearest the image's), so attention
  segments can be counted from stats that hold only ``width``, ``height`` and ``patches``.
* ``draw_sizes_for_tiles``: image sizes consistent with dynamic-tiling tile counts, for stats that hold tiles only
  (OmniBal's published stats). Dynamic tiling chooses, among the grids of ``cols x rows`` tiles with
  ``cols * rows <= max_num``, the one whose ``cols / rows`` is nearest the image's ``w / h`` (a tie goes to the
  larger grid when the image area exceeds half of that grid's pixel area) and adds a thumbnail tile when the
  grid has more than one tile. The draw: the aspect ratio log-uniform in ``[1/aspect_max, aspect_max]`` and the
  area log-uniform in ``[area_lo, area_hi] x`` the grid's pixel area ``g * 448^2``, seeded; draws whose tiling
  does not give the sample's count are rejected and drawn again. The result is *a* set of sizes consistent
  with the published tile counts, not the datasets' real sizes (which the published stats do not hold).
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from .stats import ImageStats, SampleStats

PATCH = 14  # px per patch side (the default native-resolution ViT's)
MERGE = 2  # patches per side of one LLM token
FACTOR = PATCH * MERGE
MIN_PIXELS = 56 * 56  # transformers' native-resolution image processor's defaults, px
MAX_PIXELS = 28 * 28 * 1280
TILE = 448  # tile side of OmniBal's published stats, px


def smart_resize(height, width, factor: int = FACTOR, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) int64 arrays in px the images are resized to (rule in the module docstring).

    Each side is rounded to the nearest multiple of ``factor`` (halves to even); an area over ``max_pixels``
    scales both original sides by ``sqrt(max_pixels / area)`` rounding down (at least ``factor``), one under
    ``min_pixels`` by ``sqrt(min_pixels / area)`` rounding up.
    """
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    if h.size and (h.min() <= 0 or w.min() <= 0):
        raise UserError("smart_resize: image sides must be positive")
    new_h = factor * np.round(h / factor)
    new_w = factor * np.round(w / factor)
    area = new_h * new_w
    big, small = area > max_pixels, area < min_pixels
    shrink = np.sqrt(h * w / max_pixels)
    grow = np.sqrt(min_pixels / (h * w))
    new_h = np.where(big, np.maximum(factor, factor * np.floor(h / shrink / factor)), new_h)
    new_w = np.where(big, np.maximum(factor, factor * np.floor(w / shrink / factor)), new_w)
    new_h = np.where(small, factor * np.ceil(h * grow / factor), new_h)
    new_w = np.where(small, factor * np.ceil(w * grow / factor), new_w)
    return new_h.astype(np.int64), new_w.astype(np.int64)


def native_patches(height, width, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS, patch: int = PATCH,
                   merge: int = MERGE) -> np.ndarray:
    """Patches (``patch`` x ``patch`` px) of each image after ``smart_resize`` to multiples of ``patch x merge`` px
    (``merge`` x ``merge`` patches per LLM token): int64."""
    h, w = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
    return (h // patch) * (w // patch)


def patch_grid(height, width, patches, merge: int = MERGE, search: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of each image's patch grid: ``rows * cols == patches``, both multiples of ``merge``, the
    aspect ``rows / cols`` nearest ``height / width`` (log scale) among the divisors within ``search`` merged
    rows of the ideal and the grids with at most ``search`` merged rows or columns. UserError if some count has no such factorisation there (not a smart_resize count)."""
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    p = np.asarray(patches, dtype=np.int64)
    m = p // (merge * merge)  # merged tokens
    if np.any(p != m * merge * merge) or np.any(m <= 0):
        raise UserError(f"patch_grid: patch counts must be positive multiples of {merge * merge}")
    ideal = np.sqrt(m * h / w)  # merged rows at the image's aspect
    best_rows = np.zeros_like(m)
    best_err = np.full(m.shape, np.inf)
    target = np.log(h / w)
    near = [np.maximum(1, np.round(ideal).astype(np.int64) + d) for d in range(-search, search + 1)]
    edges = [np.minimum(m, d) for d in range(1, search + 1)] + [np.maximum(1, m // d) for d in range(1, search + 1)]
    for r in near + edges:  # near the ideal, and thin grids (one side clamped at the minimum)
        ok = (m % r) == 0
        c = np.where(ok, m // np.where(ok, r, 1), 1)
        err = np.where(ok, np.abs(np.log(r / c) - target), np.inf)
        better = err < best_err
        best_rows = np.where(better, r, best_rows)
        best_err = np.where(better, err, best_err)
    if np.any(~np.isfinite(best_err)):
        bad = np.flatnonzero(~np.isfinite(best_err))[:5]
        raise UserError(f"patch_grid: no merge-aligned grid near the aspect ratio for images {bad.tolist()}")
    return best_rows * merge, (m // best_rows) * merge


# ---------------------------------------------------------------------------------------------
# dynamic tiling, for sizes drawn to match a tile count
# ---------------------------------------------------------------------------------------------
def tile_grids(max_num: int, min_num: int = 1) -> np.ndarray:
    """(k, 2) int64 ``[cols, rows]`` of every grid with ``min_num <= cols*rows <= max_num``, by increasing
    area then cols (the order dynamic tiling visits them)."""
    grids = [(c, r) for c in range(1, max_num + 1) for r in range(1, max_num + 1) if min_num <= c * r <= max_num]
    return np.array(sorted(grids, key=lambda g: (g[0] * g[1], g[0])), dtype=np.int64).reshape(-1, 2)


def tiles_of(width, height, max_num: int, min_num: int = 1, tile: int = TILE, thumbnail: bool = True) -> np.ndarray:
    """Dynamic tiling's tile count (thumbnail included) of each ``width x height`` image: int64."""
    w = np.asarray(width, dtype=np.float64)
    h = np.asarray(height, dtype=np.float64)
    aspect, area = w / h, w * h
    best = np.zeros(w.shape, dtype=np.int64)
    best_diff = np.full(w.shape, np.inf)
    for cols, rows in tile_grids(max_num, min_num):
        diff = np.abs(aspect - cols / rows)
        take = (diff < best_diff) | ((diff == best_diff) & (area > 0.5 * tile * tile * cols * rows))
        best = np.where(take, cols * rows, best)
        best_diff = np.where(diff < best_diff, diff, best_diff)
    return np.where((best > 1) & thumbnail, best + 1, best)


def draw_sizes_for_tiles(tiles, max_num: int, seed: int = 0, aspect_max: float = 4.0, area_lo: float = 0.5,
                         area_hi: float = 2.0, tile: int = TILE, rounds: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(width, height) int64 px of one image per sample whose dynamic tiling (``max_num``, thumbnail) gives
    ``tiles[i]`` tiles; the draw is in the module docstring. UserError for a count no image can have."""
    tiles = np.asarray(tiles, dtype=np.int64)
    n = len(tiles)
    grid = np.where(tiles > 1, tiles - 1, tiles)  # tiles without the thumbnail
    possible = {1} | {int(g) + 1 for g in np.prod(tile_grids(max_num), axis=1) if g > 1}
    bad = np.flatnonzero(~np.isin(tiles, sorted(possible)))
    if len(bad):
        raise UserError(f"draw_sizes_for_tiles: sample {int(bad[0])} has {int(tiles[bad[0]])} tiles, which dynamic "
                        f"tiling with max_num={max_num} and a thumbnail cannot give (possible: {sorted(possible)})")
    rng = np.random.default_rng(seed)
    width = np.zeros(n, dtype=np.int64)
    height = np.zeros(n, dtype=np.int64)
    todo = np.arange(n)
    for _ in range(rounds):
        if not len(todo):
            break
        k = len(todo)
        aspect = np.exp(rng.uniform(-np.log(aspect_max), np.log(aspect_max), k))
        area = grid[todo] * tile * tile * np.exp(rng.uniform(np.log(area_lo), np.log(area_hi), k))
        w = np.maximum(1, np.round(np.sqrt(area * aspect))).astype(np.int64)
        h = np.maximum(1, np.round(np.sqrt(area / aspect))).astype(np.int64)
        hit = tiles_of(w, h, max_num, tile=tile) == tiles[todo]
        width[todo[hit]], height[todo[hit]] = w[hit], h[hit]
        todo = todo[~hit]
    if len(todo):
        raise UserError(f"draw_sizes_for_tiles: {len(todo)} samples found no size in {rounds} rounds "
                        f"(first: sample {int(todo[0])}, {int(tiles[todo[0]])} tiles); widen aspect_max or the area range")
    return width, height


def derive_native_stats(stats: SampleStats, max_num: int | None = None, seed: int = 0,
                        tokens_per_tile: int = 256, min_pixels: int = MIN_PIXELS,
                        max_pixels: int = MAX_PIXELS, patch: int = PATCH, merge: int = MERGE) -> SampleStats:
    """Native-resolution stats from tile stats: one image per sample with ``vit > 0``, its size drawn to
    give the sample's tile count (``draw_sizes_for_tiles``; ``max_num`` defaults to the largest grid the stats
    show, ``max(vit) - 1``), its patches from ``native_patches`` (``patch`` px patches, ``merge`` x ``merge`` per
    LLM token, the pixel budget in px; the defaults are the module's constants); the sample's tokens lose
    ``tokens_per_tile`` image tokens per tile and gain ``patches / merge^2``; its text
    tokens are kept as they are (the two families' tokenizers differ: an approximation). Samples without
    tiles keep no image."""
    vit = stats.vit
    has = vit > 0
    if max_num is None:
        max_num = max(1, int(vit.max(initial=1)) - 1)
    width = np.zeros(0, dtype=np.int64)
    height = np.zeros(0, dtype=np.int64)
    if has.any():
        width, height = draw_sizes_for_tiles(vit[has], max_num, seed)
    patches = native_patches(height, width, min_pixels, max_pixels, patch, merge)
    offsets = np.zeros(len(vit) + 1, dtype=np.int64)
    np.cumsum(has.astype(np.int64), out=offsets[1:])
    images = ImageStats(offsets, width, height, patches)
    tokens = stats.tokens - tokens_per_tile * vit + images.per_sample(patches) // (merge * merge)
    if tokens.min(initial=1) <= 0:
        raise UserError(f"derive_native_stats: sample {int(np.argmin(tokens))} has fewer tokens than "
                        f"{tokens_per_tile} per tile; is tokens_per_tile right?")
    return SampleStats(vit, tokens, stats.source, list(stats.files), images)


def records_of(stats: SampleStats) -> list[dict]:
    """The stats as JSON records (``vit_num``, ``token_num`` and, when held, ``images``), ``load_stats`` format."""
    out = [{"vit_num": int(v), "token_num": int(t)} for v, t in zip(stats.vit, stats.tokens)]
    if stats.images is not None:
        im = stats.images
        for i, rec in enumerate(out):
            sl = slice(im.offsets[i], im.offsets[i + 1])
            rec["images"] = [{"width": int(w), "height": int(h), "patches": int(p)}
                             for w, h, p in zip(im.width[sl], im.height[sl], im.patches[sl])]
    return out
