"""Context parallelism's split arithmetic, tensor-free: what each CP rank of a micro-batch holds.

The trainer (``megatron/vlm/parallel/context_parallel.py``, which imports these) pads every segment of a packed micro-batch
(each sample, each run of padding) at its end to a multiple of 2 x CP tokens (2 x CP x TP with sequence parallelism,
``sp_tp`` = TP, so that TP divides every CP rank's part) and cuts it into 2 x CP equal chunks;
CP rank r keeps chunks r and 2 CP - 1 - r (balanced for causal attention: every rank attends 2 CP + 1 chunks of
each segment).  The ViT's tiles are cut into CP contiguous runs, at most ceil(tiles / CP) each; images of varying
size that cannot be cut (native-resolution ones, and videos) go whole, in contiguous runs balanced by predicted ViT
time (:func:`image_runs` of ``sample_time.grid_vit_time_units``); an image or video over one rank's share of the
micro-batch's ViT cap is refused with the flags that would fit it (:func:`video_fit`).

The planner counts a micro-batch's per-rank work from the padded lengths (:func:`padded_lengths`): its LLM tokens
are ``sum(padded)`` (each rank runs 1 / CP of them) and its attention ``sum(padded^2)`` (each rank computes
1 / CP of the causal pairs, pads included: every rank computes the same); ``MicroBatchShape(..., cp=CP)`` takes
those figures and gives the cost components one rank's share.
"""
from __future__ import annotations

import numpy as np


def padded_chunk(length: int, cp: int, sp_tp: int = 1) -> tuple[int, int]:
    """(length padded to a multiple of 2 x cp x sp_tp, chunk length = padded / (2 cp)); sp_tp: the TP size under
    sequence parallelism, else 1."""
    m = 2 * cp * sp_tp
    padded = -(-length // m) * m
    return padded, padded // (2 * cp)


def padded_lengths(lengths, cp: int, sp_tp: int = 1) -> np.ndarray:
    """Segment lengths (array-like of ints) each padded as the trainer pads them, int64: to a multiple of
    2 x cp x sp_tp under context parallelism (:func:`padded_chunk`), unchanged at cp 1 (no split, no padding; with
    sequence parallelism alone the trainer pads the row, not the segments)."""
    m = cp_multiple(cp, sp_tp)
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // m) * m


def cp_multiple(cp: int, sp_tp: int = 1) -> int:
    """The multiple the trainer pads each segment to: 2 x cp (x sp_tp, the TP size under sequence parallelism)
    with context parallelism, 1 without."""
    return 1 if cp == 1 else 2 * cp * sp_tp


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp per segment) CP rank ``rank`` holds, in its order."""
    return rank, 2 * cp - 1 - rank


def tile_ranges(n_tiles: int, cp: int) -> list[range]:
    """``n_tiles`` tiles cut into ``cp`` contiguous runs as even as whole tiles allow (the first n % cp one longer)."""
    base, extra = divmod(n_tiles, cp)
    out, start = [], 0
    for r in range(cp):
        n = base + (r < extra)
        out.append(range(start, start + n))
        start += n
    return out


def image_runs(sizes, cp: int) -> list[range]:
    """Whole images of ``sizes`` (any non-negative integer cost each: patches, or predicted time units; in
    micro-batch order) cut into ``cp`` contiguous runs whose largest
    total is the least possible (exact: a search over the cuts, O(cp x n^2) for n images); each run, from the first,
    takes as many images as fit in that total, so later runs may be empty (fewer images than ranks)."""
    sizes = [int(s) for s in sizes]
    prefix = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]) if sizes else np.zeros(1, dtype=np.int64)
    n = len(sizes)
    best = np.where(np.arange(n + 1) == 0, 0, np.iinfo(np.int64).max)  # least largest total of the first i in k runs
    for _ in range(cp):
        best = np.array([min(max(int(best[j]), int(prefix[i] - prefix[j])) for j in range(i + 1))
                         for i in range(n + 1)], dtype=np.int64)
    target = int(best[n])
    runs, start = [], 0
    for _ in range(cp):
        end = start
        while end < n and prefix[end + 1] - prefix[start] <= target:
            end += 1
        runs.append(range(start, end))
        start = end
    return runs


def chunk_pairs(length: int, cp: int, rank: int, sp_tp: int = 1) -> int:
    """Attended (query, key) pairs of CP rank ``rank`` on a segment of ``length`` tokens (pads included):
    causal within the padded segment, each of its two chunks attending to every key up to itself."""
    _, c = padded_chunk(length, cp, sp_tp)
    return sum(c * i * c + c * (c + 1) // 2 for i in rank_chunks(cp, rank))


def rank_pairs_padded(lengths, cp: int, sp_tp: int = 1) -> np.ndarray:
    """Per segment, the attended pairs (pads included) of every CP rank, equal on all ranks (the closed form of
    :func:`chunk_pairs`): P (P + 1) / (2 cp) for the padded length P = 2 cp c, i.e. P^2 / (2 cp) + c."""
    p = padded_lengths(lengths, cp, sp_tp)
    return p * (p + 1) // (2 * cp)


def rank_work(lengths, tiles: int, cp: int, real_only: bool = True, sp_tp: int = 1) -> tuple[list[int], list[int]]:
    """(attended pairs, ViT tiles) of each CP rank for a micro-batch of samples of ``lengths`` tokens and ``tiles``
    tiles, split as the trainer's ``split_batch`` splits it.  real_only: pairs of real tokens only (a query and a
    key of the sample; pads excluded), else every pair the attention computes (pads included: equal on every
    rank); sp_tp: the TP size under sequence parallelism (segments padded to 2 x cp x sp_tp)."""
    pairs = [0] * cp
    for length in lengths:
        length = int(length)
        if not real_only:
            for r in range(cp):
                pairs[r] += chunk_pairs(length, cp, r, sp_tp)
            continue
        _, c = padded_chunk(length, cp, sp_tp)
        for r in range(cp):
            for i in rank_chunks(cp, r):  # query q (0-based) attends keys 0..q: q + 1 pairs, real queries only
                lo, hi = i * c, min((i + 1) * c, length)
                if hi > lo:
                    pairs[r] += (hi * (hi + 1) - lo * (lo + 1)) // 2
    return pairs, [len(t) for t in tile_ranges(int(tiles), cp)]


def rank_vit_budget(vit_cap: int, cp: int) -> int:
    """ViT items one CP rank holds at most when a micro-batch of ``vit_cap`` items is shared by ``cp`` ranks: the
    even share ``ceil(vit_cap / cp)`` (the memory plan's per-rank ViT activations); a whole image or video over it
    cannot go to one rank within the plan."""
    return -(-int(vit_cap) // cp)


def video_fit(frames: int, temporal: int, patches: int, budget: int, temporal_patch: int, min_pixels: int = 0,
              patch_px: int = 14, merge: int = 2) -> tuple[int | None, int | None]:
    """(most frames, most pixels per frame) that bring a video of ``frames`` sampled frames, ``temporal`` temporal
    patches and ``patches`` ViT items (``temporal`` segments of ``patches / temporal``) within ``budget`` items:
    ``--video-max-frames``, the largest multiple of ``temporal_patch`` frames whose temporal patches at this frame
    size fit (None: not even one fits), and ``--video-max-pixels``, the largest frame area whose patches (whole
    merged tokens of ``merge x merge`` patches of ``patch_px`` px) times ``temporal`` fit (None: below the rule's
    ``min_pixels`` px or one merged token per frame)."""
    per_segment = patches // temporal
    segments = budget // per_segment
    max_frames = segments * temporal_patch if segments >= 1 else None
    per_frame = budget // temporal // (merge * merge) * (merge * merge)
    max_pixels = per_frame * patch_px * patch_px
    max_pixels = max_pixels if per_frame >= merge * merge and max_pixels >= min_pixels else None
    return (min(max_frames, frames) if max_frames is not None else None), max_pixels
