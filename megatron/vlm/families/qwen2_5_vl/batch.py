"""Qwen2.5-VL micro-batches for the logits check: transformers' processor outputs -> the fields the family's
stage reads (``components``' docstring lists them), built on the host from ``vision_windows`` (window order,
boundaries, 2-D rotary ids) and ``positions`` (3-D multimodal RoPE ids as ``get_rope_index`` gives them).
``vision_fields`` serves the training micro-batches too (``data.QwenBatcher``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron.vlm.micro_batch import MicroBatch, VisionPart, reads
from omnibal_ext.errors import UserError

from .positions import mrope_position_ids
from .vision_windows import rotary_position_ids, vision_windows


@dataclass(frozen=True)
class QwenVision(VisionPart):
    """Qwen2.5-VL's vision part of a micro-batch (``components``' docstring says what each field holds): the pixel
    rows and the ViT's window fields where the ViT embedding is, the 3-D RoPE ids where LLM layers are; the drop
    path's ``tile_keys`` (per patch row) everywhere."""

    pixel_values: torch.Tensor | None = reads("pixels")
    image_grid_thw: torch.Tensor | None = reads("pixels")
    vision_patch_index: torch.Tensor | None = reads("pixels")
    vision_merged_inverse: torch.Tensor | None = reads("pixels")
    vision_rotary_ids: torch.Tensor | None = reads("pixels")
    vision_cu_window_seqlens: torch.Tensor | None = reads("pixels")
    vision_max_window_seqlen: int | None = reads("pixels")
    vision_cu_seqlens: torch.Tensor | None = reads("pixels")
    vision_max_seqlen: int | None = reads("pixels")
    mrope_position_ids: torch.Tensor | None = reads("packing")


def vision_fields(grid_thw, spec) -> dict:
    """The ViT's host-built fields of the images ``grid_thw [n, 3]`` (patches) of one micro-batch."""
    v = spec.vision
    grids = [tuple(int(x) for x in g) for g in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
    w = vision_windows(grids, v.window_size, v.patch_size, v.spatial_merge_size)
    rotary = rotary_position_ids(grids, v.spatial_merge_size)[w.patch_index]
    return {"image_grid_thw": torch.tensor(grids, dtype=torch.int64),
            "vision_patch_index": torch.from_numpy(w.patch_index),
            "vision_merged_inverse": torch.from_numpy(w.merged_inverse),
            "vision_rotary_ids": torch.from_numpy(rotary),
            "vision_cu_window_seqlens": torch.from_numpy(w.cu_window_seqlens),
            "vision_max_window_seqlen": w.max_window_seqlen,
            "vision_cu_seqlens": torch.from_numpy(w.cu_seqlens), "vision_max_seqlen": w.max_seqlen}


def logits_batch(inputs: dict, spec, info, fields=vision_fields, vision: type[VisionPart] = QwenVision) -> MicroBatch:
    """One sample from transformers' inputs: ``input_ids [1, s]``, ``pixel_values [patches, C*T*p*p]``,
    ``image_grid_thw [n, 3]`` and ``mm_token_type_ids [1, s]`` (1 on image tokens; without it the image
    tokens are those equal to the config's ``image_token_id``). ``fields(grid_thw, spec)``: the ViT's host-built
    fields and ``vision`` their part (a family with Qwen2.5-VL's text side and positions but another ViT passes its
    own)."""
    ids = inputs["input_ids"].reshape(-1).to(torch.int64)
    s = ids.shape[0]
    grids = inputs.get("image_grid_thw")
    types = inputs.get("mm_token_type_ids")
    if types is not None:
        image = types.reshape(-1).numpy() == 1
        if info.image_token_id is not None and not np.array_equal(image, ids.numpy() == info.image_token_id):
            raise UserError("mm_token_type_ids marks other tokens than the image_token_id ones")
    elif info.image_token_id is not None:
        image = ids.numpy() == info.image_token_id
    else:
        raise UserError("no mm_token_type_ids and no image_token_id in config.json: the image tokens are unknown")
    grid_list = [] if grids is None else [tuple(int(x) for x in g) for g in grids.reshape(-1, 3).tolist()]
    positions, _ = mrope_position_ids(image.astype(np.int64), grid_list, 1, spec.vision.spatial_merge_size)
    batch = {"tokens": ids.reshape(1, s), "labels": torch.zeros(1, s, dtype=torch.int64),
             "mrope_position_ids": torch.from_numpy(positions).reshape(3, 1, s),
             "cu_seqlens": torch.tensor([0, s], dtype=torch.int32), "max_seqlen": s,
             "segment_ids": torch.zeros(1, s, dtype=torch.int64), "position_ids": torch.arange(s).reshape(1, s),
             "sample_tokens": torch.tensor([s]),
             "sample_tiles": torch.tensor([sum(t * h * w for t, h, w in grid_list)])}  # patch rows, as training's
    if grid_list:
        batch["pixel_values"] = inputs["pixel_values"].to(torch.float32)
        batch.update(fields(grid_list, spec))
    return MicroBatch.of(batch, vision)
