"""Qwen2.5-VL vision encoder bookkeeping: window attention order, sequence boundaries, 2-D rotary ids.

Patch tokens arrive in the image processor's order (``image_processing.patchify``): per image, per frame,
merge groups row-major, the ``m x m`` patches of a group consecutive (``m`` = spatial_merge_size, 2).  A
*merged token* is one group of ``m*m`` patch tokens (one LLM token later).

Window attention: each frame's merged grid ``(h/m) x (w/m)`` is cut into square windows of
``s = window_size // m // patch_size`` merged tokens per side (112 px published: 4 merged tokens = 8 patches
= 112 px), starting top-left; windows at the bottom and right edges are smaller when the grid is not a
multiple of ``s``.  The encoder permutes merged tokens (with their ``m*m`` patches) so each window is
contiguous: frames in order, windows row-major, merged tokens of a window row-major.  Window-attention
layers attend within ``cu_window_seqlens``, full-attention layers within ``cu_seqlens`` (one segment per
frame of each image, unchanged by the permutation since windows never cross a frame).  The merger's output
is put back in processor order with the inverse permutation.

The same as transformers' ``get_vision_window_index`` / ``get_vision_cu_seqlens`` /
``get_vision_position_ids`` that ``Qwen2_5_VisionTransformerPretrainedModel.forward`` calls (empty windows
never appear here; the reference drops them from its boundaries too).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionWindows:
    """Window order of the patch tokens of some images (all int64 but the int32 boundaries).

    ``merged_index[k]`` is the processor-order index of the merged token at window-order place ``k``
    (the reference's ``window_index``); ``merged_inverse`` undoes it (``x_window[merged_inverse]`` is in
    processor order).  ``patch_index`` / ``patch_inverse`` are the same permutation on patch tokens.
    ``cu_window_seqlens`` ``[windows + 1]`` and ``cu_seqlens`` ``[frames + 1]`` are boundaries in patch tokens.
    """

    merged_index: np.ndarray
    merged_inverse: np.ndarray
    patch_index: np.ndarray
    patch_inverse: np.ndarray
    cu_window_seqlens: np.ndarray
    cu_seqlens: np.ndarray

    @property
    def max_window_seqlen(self) -> int:
        """Longest window, patch tokens."""
        return int(np.diff(self.cu_window_seqlens).max())

    @property
    def max_seqlen(self) -> int:
        """Longest frame, patch tokens."""
        return int(np.diff(self.cu_seqlens).max())


def _grids(grid_thw, merge: int) -> list[tuple[int, int, int]]:
    grids = [tuple(int(v) for v in g) for g in (grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw)]
    if not grids:
        raise ValueError("vision windows: no images")
    for g in grids:
        t, h, w = g
        if t < 1 or h < merge or w < merge or h % merge or w % merge:
            raise ValueError(f"grid_thw {g} is not a positive grid of whole {merge}x{merge} merge groups")
    return grids


def frame_cu_seqlens(grid_thw: Sequence[Sequence[int]]) -> np.ndarray:
    """Boundaries ``int32 [frames + 1]`` in patch tokens: one segment of ``h*w`` per frame of each image."""
    lengths = [h * w for t, h, w in _grids(grid_thw, 1) for _ in range(t)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def vision_windows(grid_thw: Sequence[Sequence[int]], window_size: int = 112, patch_size: int = 14,
                   spatial_merge_size: int = 2) -> VisionWindows:
    """Window permutation and boundaries of images with ``grid_thw`` ``(t, h, w)`` patches each.

    ``window_size`` and ``patch_size`` in px; a window is ``window_size // spatial_merge_size // patch_size``
    merged tokens per side (must be at least 1).
    """
    m = spatial_merge_size
    side = window_size // m // patch_size
    if side < 1:
        raise ValueError(f"vision windows: window_size {window_size} px is smaller than one merged token "
                         f"({m} x {patch_size} px)")
    order, window_lengths = [], []
    offset = 0  # merged tokens of the previous images
    for t, h, w in _grids(grid_thw, m):
        gh, gw = h // m, w // m
        rows_of_windows, cols_of_windows = -(-gh // side), -(-gw // side)
        row = np.arange(gh)[:, None]
        col = np.arange(gw)[None, :]
        window = (row // side) * cols_of_windows + col // side  # [gh, gw]: window number within a frame
        frame_windows = rows_of_windows * cols_of_windows
        key = (np.arange(t)[:, None, None] * frame_windows + window[None]).reshape(-1)
        # a stable sort keeps processor (row-major) order within each window
        order.append(np.argsort(key, kind="stable") + offset)
        window_lengths.append(np.bincount(key, minlength=t * frame_windows))
        offset += t * gh * gw
    merged_index = np.concatenate(order).astype(np.int64)
    unit = m * m
    patch_index = (merged_index[:, None] * unit + np.arange(unit)).reshape(-1)
    lengths = np.concatenate(window_lengths) * unit
    return VisionWindows(
        merged_index=merged_index,
        merged_inverse=np.argsort(merged_index).astype(np.int64),
        patch_index=patch_index,
        patch_inverse=np.argsort(patch_index).astype(np.int64),
        cu_window_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        cu_seqlens=frame_cu_seqlens(grid_thw),
    )


def rotary_position_ids(grid_thw: Sequence[Sequence[int]], spatial_merge_size: int = 2) -> np.ndarray:
    """2-D rotary ids ``int64 [patches, 2]`` (columns: patch row h, patch column w within its image) of every
    patch token, in processor order (the encoder applies the window permutation to them afterwards).

    Per image and frame: merge groups row-major, within a group its ``m x m`` patches row-major, so a group
    at merged (i, j) holds ids ``(i*m + a, j*m + b)`` for ``a, b < m``; every frame repeats the ids.
    """
    m = spatial_merge_size
    parts = []
    for t, h, w in _grids(grid_thw, m):
        shape = (h // m, w // m, m, m)  # group row, group col, row in group, col in group
        rows = np.broadcast_to(np.arange(h).reshape(h // m, 1, m, 1), shape).reshape(-1)
        cols = np.broadcast_to(np.arange(w).reshape(1, w // m, 1, m), shape).reshape(-1)
        parts.append(np.tile(np.stack([rows, cols], axis=1), (t, 1)))
    return np.concatenate(parts).astype(np.int64)
