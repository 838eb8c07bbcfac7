"""Qwen3-VL micro-batches for the logits check: transformers' processor outputs -> the fields the family's stage
reads (``components``' docstring lists them). The text side (3-D multimodal RoPE ids as ``get_rope_index`` gives
them for images, the image-token check) is Qwen2.5-VL's ``batch.logits_batch``; the ViT's host-built fields are
``vision_fields`` (the training micro-batches use it too).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from megatron.vlm.lineages.qwen import batch as qwen2_5_vl_batch
from megatron.vlm.lineages.qwen.positions import mrope_position_ids
from megatron.vlm.lineages.qwen.vision_windows import frame_cu_seqlens, rotary_position_ids
from megatron.vlm.stage.micro_batch import VisionPart, reads


@dataclass(frozen=True)
class Qwen3Vision(VisionPart):
    """Qwen3-VL's vision part of a micro-batch (``components``' docstring says what each field holds): the pixel
    rows and the ViT's fields where the ViT embedding is, the 3-D RoPE ids where LLM layers are, the token types
    where the LLM embedding or LLM layers are (DeepStack adds at the image tokens); ``tile_keys`` everywhere."""

    pixel_values: torch.Tensor | None = reads("pixels")
    image_grid_thw: torch.Tensor | None = reads("pixels")
    vision_rotary_ids: torch.Tensor | None = reads("pixels")
    vision_pos_index: torch.Tensor | None = reads("pixels")
    vision_pos_weight: torch.Tensor | None = reads("pixels")
    vision_cu_seqlens: torch.Tensor | None = reads("pixels")
    vision_max_seqlen: int | None = reads("pixels")
    vision_item_types: torch.Tensor | None = reads("pixels")
    mrope_position_ids: torch.Tensor | None = reads("packing")
    mm_token_type_ids: torch.Tensor | None = reads("tokens", "packing")


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (2 per target, int64) into a ``side``-long table and their fp32 weights, ``align_corners=True``:
    target ``i`` of an axis of ``size`` sits at ``i * (side - 1) / (size - 1)`` of the table."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    taps = floor.long()[:, None] + torch.arange(2)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights


def position_taps(grid_thw, side: int, spatial_merge_size: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the ``side x side`` learned position table (int64 ``[patches, 4]``) and their weights (fp32
    ``[patches, 4]``) whose weighted sum is each patch's interpolated position (processor order: per image and
    frame, merge groups row-major, their ``m x m`` patches row-major)."""
    grids = [tuple(int(x) for x in g) for g in grid_thw]
    ids = torch.from_numpy(rotary_position_ids(grids, spatial_merge_size))  # [patches, 2]: row, column
    counts = [t * h * w for t, h, w in grids]
    heights = torch.repeat_interleave(torch.tensor([h for _, h, _ in grids]), torch.tensor(counts))
    widths = torch.repeat_interleave(torch.tensor([w for _, _, w in grids]), torch.tensor(counts))
    rt, rw = _axis_taps(ids[:, 0], heights, side)
    ct, cw = _axis_taps(ids[:, 1], widths, side)
    index = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
    weight = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    return index.numpy(), weight.numpy()


def vision_fields(grid_thw, spec) -> dict:
    """The ViT's host-built fields of the images ``grid_thw [n, 3]`` (patches) of one micro-batch: the grids, the
    2-D rotary ids, the position-table taps and the per-frame attention bounds (patches stay in processor order)."""
    v = spec.vision
    grids = [tuple(int(x) for x in g) for g in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
    index, weight = position_taps(grids, v.position_grid_side, v.spatial_merge_size)
    cu = frame_cu_seqlens(grids)
    return {"image_grid_thw": torch.tensor(grids, dtype=torch.int64),
            "vision_rotary_ids": torch.from_numpy(rotary_position_ids(grids, v.spatial_merge_size)),
            "vision_pos_index": torch.from_numpy(index), "vision_pos_weight": torch.from_numpy(weight),
            "vision_cu_seqlens": torch.from_numpy(cu), "vision_max_seqlen": int(np.diff(cu).max())}


def qwen3_positions(types: np.ndarray, items: list, spec) -> np.ndarray:
    """Qwen3-VL's ``get_rope_index`` ids [3, s] of one sample: an image as Qwen2.5-VL's, a video of ``t`` temporal
    patches as ``t`` blocks of ``grid_thw (1, h, w)`` (each its own run of tokens between its timestamp text and
    ``<|vision_start|>``/``<|vision_end|>``), no time scaling (``positions`` module docstring)."""
    grids = [g for item in items for g in ([item.grid] if item.kind == qwen2_5_vl_batch.IMAGE
                                           else [(1, item.grid[1], item.grid[2])] * item.grid[0])]
    ids, _ = mrope_position_ids(types, grids, (qwen2_5_vl_batch.IMAGE, qwen2_5_vl_batch.VIDEO),
                                spec.vision.spatial_merge_size)
    return ids


QWEN3_VL_INPUTS = qwen2_5_vl_batch.QWEN2_5_VL_INPUTS - {"second_per_grid_ts"}  # a Qwen2.5-VL input only

logits_batch = functools.partial(qwen2_5_vl_batch.logits_batch, fields=vision_fields, vision=Qwen3Vision,
                                 positions=qwen3_positions, accepted=QWEN3_VL_INPUTS, video_times=False)
