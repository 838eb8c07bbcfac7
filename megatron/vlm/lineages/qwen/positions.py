"""3-D multimodal RoPE (M-RoPE) position ids of Qwen2.5-VL samples, for packed (THD) rows.

Every token gets three position ids (temporal, height, width).  Within one sample, starting at 0:

* a text token has the same id on all three axes, one more than the previous text token, or
  ``start + max(grid_h, grid_w) // merge`` after an image that started at ``start`` (for a still image,
  whose temporal id is ``start``, that is the image's largest id + 1);
* the ``t * (h/m) * (w/m)`` tokens of an image with ``grid_thw = (t, h, w)`` patches (``m`` = spatial merge
  size) are its merged grid in row-major order (frame, row, column); token ``(f, i, j)`` has ids
  ``(start + f, start + i, start + j)`` where ``start`` is the id the next text token would have had.

A video is such a block too (``grid_thw = (t, h, w)``, ``<|video_pad|>`` tokens) whose temporal ids are spaced in
time: temporal patch ``f`` has ``start + int(f * tokens_per_second * second_per_grid_ts)`` (the product in
float32 and truncated, as transformers computes it; ``time_steps``); the text after it still goes on from
``start + max(h, w) // merge``.

This is what transformers' ``Qwen2_5_VLModel.get_rope_index`` computes for images and videos.  ``mrope_position_delta`` = largest id + 1 - sample length: the offset between a token's
1-D index and its id after the sample (the reference keeps it for generation).

Packing: each sample of a packed row restarts at 0 (``packed_mrope_position_ids``), as the reference gives
each sequence of a batch its own ids.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omnibal_ext.errors import UserError


class ImageTokenError(UserError):
    """A sample whose image-placeholder tokens do not match its images' grids."""


def _image_tokens(grid: Sequence[int], merge: int) -> int:
    t, h, w = (int(v) for v in grid)
    if t < 1 or h < merge or w < merge or h % merge or w % merge:
        raise ValueError(f"grid_thw {tuple(grid)} is not a positive grid of whole {merge}x{merge} merge groups")
    return t * (h // merge) * (w // merge)


def temporal_ids(t: int, step: float | None) -> np.ndarray:
    """Temporal ids (from 0) of ``t`` temporal patches: ``0..t-1`` (an image, ``step`` None), else
    ``int(f * step)`` with ``step = tokens_per_second * second_per_grid_ts`` (a video) in float32, truncated."""
    if step is None:
        return np.arange(t, dtype=np.int64)
    return (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)


def video_time_step(tokens_per_second: int, second_per_grid_ts: float) -> float:
    """``tokens_per_second * second_per_grid_ts`` in float32 (transformers multiplies the int by the float32
    tensor the processor returns)."""
    return float(np.float32(tokens_per_second) * np.float32(second_per_grid_ts))


def mrope_position_ids(token_ids, image_grids: Sequence[Sequence[int]], image_token_id, spatial_merge_size: int = 2,
                       where: str | None = None,
                       time_steps: Sequence[float | None] | None = None) -> tuple[np.ndarray, int]:
    """Position ids ``int64 [3, seq]`` (rows: temporal, height, width) of one sample and its
    ``mrope_position_delta`` (an int).

    ``token_ids``: the sample's ``seq`` token ids (sequence, numpy or torch 1-D); its images' placeholder tokens
    (``image_token_id``, ``<|image_pad|>``; a tuple of ids: images' and videos' tokens) come in runs, image ``k`` taking the next
    ``t*h*w // spatial_merge_size**2`` of them for ``image_grids[k] = (t, h, w)`` (patches).  Two images may
    follow each other without a token between them.  Refuses (``ImageTokenError``, ``where`` such as
    ``file:line`` starting the message) a sample whose placeholder count differs from its grids' or
    whose image would be cut by a text token.  ``time_steps[k]``: the temporal id step of item ``k``
    (``video_time_step`` for a video, None for an image; None: all images).
    """
    ids = np.asarray(token_ids).reshape(-1)
    seq = ids.shape[0]
    if seq == 0:
        raise ValueError("mrope_position_ids: empty sample")
    prefix = f"{where}: " if where else ""
    counts = [_image_tokens(g, spatial_merge_size) for g in image_grids]
    is_image = np.isin(ids, np.asarray(image_token_id).reshape(-1))
    steps = list(time_steps) if time_steps is not None else [None] * len(counts)
    if len(steps) != len(counts):
        raise ValueError(f"mrope_position_ids: {len(steps)} time steps for {len(counts)} items")
    if int(is_image.sum()) != sum(counts):
        raise ImageTokenError(f"{prefix}{int(is_image.sum())} image placeholder tokens but the "
                              f"{len(counts)} image(s) need {sum(counts)}")
    out = np.empty((3, seq), dtype=np.int64)
    pos = 0  # sample position of the next token
    next_id = 0  # id the next text token gets
    image_starts = np.flatnonzero(is_image)
    cursor = 0  # into image_starts
    for k, (grid, n) in enumerate(zip(image_grids, counts)):
        start = int(image_starts[cursor])
        if not is_image[start:start + n].all():
            raise ImageTokenError(f"{prefix}image {k} (grid_thw {tuple(int(v) for v in grid)}) needs {n} "
                                  f"consecutive placeholder tokens from position {start}; a text token cuts it")
        text = start - pos
        out[:, pos:start] = next_id + np.arange(text)
        next_id += text
        t, h, w = (int(v) for v in grid)
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, start:start + n] = next_id + temporal_ids(t, steps[k])[frame.reshape(-1)]
        out[1, start:start + n] = next_id + row.reshape(-1)
        out[2, start:start + n] = next_id + col.reshape(-1)
        next_id += max(h, w) // spatial_merge_size
        pos = start + n
        cursor += n
    out[:, pos:] = next_id + np.arange(seq - pos)
    return out, int(out.max()) + 1 - seq


def packed_mrope_position_ids(token_ids, cu_seqlens: Sequence[int],
                              image_grids: Sequence[Sequence[Sequence[int]]], image_token_id: int,
                              spatial_merge_size: int = 2,
                              wheres: Sequence[str | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Position ids ``int64 [3, total]`` of a packed row and the per-sample deltas ``int64 [samples]``.

    Sample ``s`` is ``token_ids[cu_seqlens[s]:cu_seqlens[s+1]]`` (tokens) with images ``image_grids[s]``; its
    ids restart at 0.  Tokens after ``cu_seqlens[-1]`` (padding) get ids continuing from 0 like text
    (a row of text, never attended by a sample).  ``wheres[s]`` names sample ``s`` in errors.
    """
    ids = np.asarray(token_ids).reshape(-1)
    bounds = [int(b) for b in cu_seqlens]
    if len(bounds) != len(image_grids) + 1 or bounds[0] != 0 or any(hi < lo for lo, hi in zip(bounds, bounds[1:])) \
            or bounds[-1] > ids.shape[0]:
        raise ValueError(f"packed_mrope_position_ids: cu_seqlens {bounds} do not split {ids.shape[0]} tokens "
                         f"into {len(image_grids)} samples")
    out = np.empty((3, ids.shape[0]), dtype=np.int64)
    deltas = np.zeros(len(image_grids), dtype=np.int64)
    for s, grids in enumerate(image_grids):
        lo, hi = bounds[s], bounds[s + 1]
        if hi == lo:
            raise ValueError(f"packed_mrope_position_ids: sample {s} is empty")
        where = wheres[s] if wheres is not None else None
        out[:, lo:hi], deltas[s] = mrope_position_ids(ids[lo:hi], grids, image_token_id, spatial_merge_size, where)
    out[:, bounds[-1]:] = np.arange(ids.shape[0] - bounds[-1])
    return out, deltas
