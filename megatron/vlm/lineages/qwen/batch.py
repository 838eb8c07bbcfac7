"""Qwen2.5-VL micro-batches for the logits check: transformers' processor outputs -> the fields the family's
stage reads (``components``' docstring lists them), built on the host from ``vision_windows`` (window order,
boundaries, 2-D rotary ids) and ``positions`` (3-D multimodal RoPE ids as ``get_rope_index`` gives them).
``vision_fields`` serves the training micro-batches too (``data.QwenBatcher``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnibal_ext.errors import UserError

from .positions import mrope_position_ids, video_time_step
from .vision_windows import rotary_position_ids, vision_windows
from megatron.vlm.stage.micro_batch import MicroBatch, VisionPart, reads


@dataclass(frozen=True)
class QwenVision(VisionPart):
    """Qwen2.5-VL's vision part of a micro-batch (``components``' docstring says what each field holds): the pixel
    rows and the ViT's window fields where the ViT embedding is (``image_grid_thw [items, 3]``: every ViT item's
    grid, images' and videos' in text order; ``vision_item_types [items]``: IMAGE 1 or VIDEO 2 each), the 3-D RoPE
    ids where LLM layers are, ``mm_token_type_ids [b, s]`` (0 text, 1 image, 2 video token: where the merged
    features go, in order) where the LLM embedding is; the drop path's ``tile_keys`` (per patch row) everywhere."""

    pixel_values: torch.Tensor | None = reads("pixels")
    image_grid_thw: torch.Tensor | None = reads("pixels")
    vision_patch_index: torch.Tensor | None = reads("pixels")
    vision_merged_inverse: torch.Tensor | None = reads("pixels")
    vision_rotary_ids: torch.Tensor | None = reads("pixels")
    vision_cu_window_seqlens: torch.Tensor | None = reads("pixels")
    vision_max_window_seqlen: int | None = reads("pixels")
    vision_cu_seqlens: torch.Tensor | None = reads("pixels")
    vision_max_seqlen: int | None = reads("pixels")
    vision_item_types: torch.Tensor | None = reads("pixels")
    mrope_position_ids: torch.Tensor | None = reads("packing")
    mm_token_type_ids: torch.Tensor | None = reads("tokens")


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


TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values (transformers' processor)
QWEN2_5_VL_INPUTS = frozenset({"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids",
                               "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"})


@dataclass(frozen=True)
class VisionItem:
    """One ViT item of a sample, in the order its tokens come in the text: ``kind`` IMAGE or VIDEO, ``grid``
    ``(t, h, w)`` patches, ``second_per_grid_ts`` s per temporal patch (a Qwen2.5-VL video; None: an image, or a
    family without it), ``rows`` its pixel rows (``[t*h*w, C*T*p*p]``)."""

    kind: int
    grid: tuple[int, int, int]
    second_per_grid_ts: float | None = None
    rows: torch.Tensor | None = None


def token_types(ids: np.ndarray, inputs: dict, info) -> np.ndarray:
    """``mm_token_type_ids`` of the sample (int64 [s]): the input's, checked against the config's image and video
    token ids where it names them; else made from those ids."""
    video_id = info.video_token_id
    given = inputs.get("mm_token_type_ids")
    if given is not None:
        types = given.reshape(-1).numpy().astype(np.int64)
        if types.shape != ids.shape:
            raise UserError(f"mm_token_type_ids has {types.size} entries for {ids.size} input_ids")
        bad = set(np.unique(types).tolist()) - {TEXT, IMAGE, VIDEO}
        if bad:
            raise UserError(f"mm_token_type_ids holds {sorted(bad)}: only 0 (text), 1 (image), 2 (video) exist")
        for kind, tid, name in ((IMAGE, info.image_token_id, "image_token_id"), (VIDEO, video_id, "video_token_id")):
            if tid is not None and not np.array_equal(types == kind, ids == tid):
                raise UserError(f"mm_token_type_ids marks other tokens {kind} than the {name} ones")
        return types
    if info.image_token_id is None:
        raise UserError("no mm_token_type_ids and no image_token_id in config.json: the image tokens are unknown")
    types = np.where(ids == info.image_token_id, IMAGE, TEXT).astype(np.int64)
    if video_id is not None:
        types[ids == video_id] = VIDEO
    return types


def vision_items(types: np.ndarray, inputs: dict, merge: int, video_times: bool) -> list[VisionItem]:
    """The images (``pixel_values``, ``image_grid_thw``) and videos (``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts`` where ``video_times``) in the order their placeholder runs come in ``types``; an item
    takes the next ``t*h*w / merge^2`` tokens of its kind, over several runs (Qwen3-VL: one per temporal patch)."""
    queues = {}
    for kind, name, pixels in ((IMAGE, "image_grid_thw", "pixel_values"), (VIDEO, "video_grid_thw",
                                                                            "pixel_values_videos")):
        grids = inputs.get(name)
        grids = [] if grids is None else [tuple(int(x) for x in g) for g in grids.reshape(-1, 3).tolist()]
        rows = inputs.get(pixels)
        need = sum(t * h * w for t, h, w in grids)
        if (rows is None and need) or (rows is not None and rows.shape[0] != need):
            raise UserError(f"{pixels}: {None if rows is None else rows.shape[0]} patch rows but {name} needs {need}")
        seconds = inputs.get("second_per_grid_ts") if kind == VIDEO else None
        if seconds is not None:
            seconds = [float(x) for x in torch.as_tensor(seconds, dtype=torch.float32).reshape(-1).tolist()]
            if len(seconds) != len(grids):
                raise UserError(f"second_per_grid_ts has {len(seconds)} entries for {len(grids)} videos")
        items, first = [], 0
        for k, (t, h, w) in enumerate(grids):
            s = (seconds[k] if seconds is not None else 1.0) if kind == VIDEO and video_times else None
            items.append(VisionItem(kind, (t, h, w), s, rows[first:first + t * h * w].to(torch.float32)))
            first += t * h * w
        queues[kind] = items
    order, left = [], 0  # left: tokens the current item still takes
    for pos in np.flatnonzero(types != TEXT):
        kind = int(types[pos])
        if left == 0:
            if not queues[kind]:
                raise UserError(f"{'image' if kind == IMAGE else 'video'} tokens at position {pos} beyond the "
                                f"{'image' if kind == IMAGE else 'video'}_grid_thw items")
            order.append(queues[kind].pop(0))
            t, h, w = order[-1].grid
            left = t * h * w // merge ** 2
        elif order[-1].kind != kind:
            raise UserError(f"position {pos}: a {'video' if kind == VIDEO else 'image'} token inside the previous "
                            "item's placeholder tokens")
        left -= 1
    if left or queues[IMAGE] or queues[VIDEO]:
        raise UserError("the placeholder tokens do not match image_grid_thw / video_grid_thw (tokens per item: "
                        f"t*h*w / {merge ** 2})")
    return order


def qwen2_5_positions(types: np.ndarray, items: list[VisionItem], spec) -> np.ndarray:
    """``get_rope_index``'s ids [3, s] of one sample: images and videos as blocks, a video's temporal ids spaced by
    ``tokens_per_second * second_per_grid_ts``."""
    tps = spec.vision.tokens_per_second
    steps = [None if i.kind == IMAGE else video_time_step(tps, i.second_per_grid_ts) for i in items]
    positions, _ = mrope_position_ids(types, [i.grid for i in items], (IMAGE, VIDEO), spec.vision.spatial_merge_size,
                                      time_steps=steps)
    return positions


def logits_batch(inputs: dict, spec, info, fields=vision_fields, vision: type[VisionPart] = QwenVision,
                 positions=qwen2_5_positions, accepted: frozenset = QWEN2_5_VL_INPUTS,
                 video_times: bool = True) -> MicroBatch:
    """One sample from transformers' inputs (``accepted`` keys; any other is refused, never ignored):
    ``input_ids [1, s]``, ``pixel_values [patches, C*T*p*p]`` / ``image_grid_thw [n, 3]``, ``pixel_values_videos``
    / ``video_grid_thw [v, 3]`` (``second_per_grid_ts [v]`` where ``video_times``) and ``mm_token_type_ids [1, s]``
    (1 on image tokens, 2 on video tokens; without it they are those equal to the config's ``image_token_id`` /
    ``video_token_id``); ``attention_mask`` only all ones. The ViT runs images and videos in one pass, in text order.
    ``fields(grid_thw, spec)``: the ViT's host-built fields and ``vision`` their part, ``positions(types, items,
    spec)`` the 3-D RoPE ids (a family with Qwen2.5-VL's text side but another ViT or video layout passes its own)."""
    unknown = sorted(set(inputs) - accepted)
    if unknown:
        raise UserError(f"inputs {unknown}: not implemented for the {spec.family} family (it takes "
                        f"{sorted(accepted)})")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise UserError("attention_mask with zeros (padding) is not implemented: give one unpadded sample")
    ids = inputs["input_ids"].reshape(-1).to(torch.int64)
    s = ids.shape[0]
    types = token_types(ids.numpy(), inputs, info)
    items = vision_items(types, inputs, spec.vision.spatial_merge_size, video_times)
    ids_3d = positions(types, items, spec)
    grid_list = [i.grid for i in items]
    batch = {"tokens": ids.reshape(1, s), "labels": torch.zeros(1, s, dtype=torch.int64),
             "mrope_position_ids": torch.from_numpy(ids_3d).reshape(3, 1, s),
             "mm_token_type_ids": torch.from_numpy(types).reshape(1, s),
             "cu_seqlens": torch.tensor([0, s], dtype=torch.int32), "max_seqlen": s,
             "segment_ids": torch.zeros(1, s, dtype=torch.int64), "position_ids": torch.arange(s).reshape(1, s),
             "sample_tokens": torch.tensor([s]),
             "sample_tiles": torch.tensor([sum(t * h * w for t, h, w in grid_list)])}  # patch rows, as training's
    if grid_list:
        batch["pixel_values"] = torch.cat([i.rows for i in items])
        batch["vision_item_types"] = torch.tensor([i.kind for i in items], dtype=torch.int64)
        batch.update(fields(grid_list, spec))
    return MicroBatch.of(batch, vision)
