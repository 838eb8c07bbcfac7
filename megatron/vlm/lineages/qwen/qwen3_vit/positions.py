"""Qwen3-VL's token types and 3-D multimodal RoPE position ids of a sample, for packed (THD) rows.

``mm_token_type_ids``: what transformers' processor returns beside ``input_ids`` (``ProcessorMixin.
create_mm_token_type_ids``): 1 on the image placeholder tokens (``<|image_pad|>``), 2 on the video ones
(``<|video_pad|>``), 0 elsewhere (the ``<|vision_start|>`` / ``<|vision_end|>`` tokens around an image are text).
Qwen3-VL's forward refuses image inputs without them; its ``get_rope_index`` finds the images by them.

Position ids: for images, Qwen3-VL's ``get_rope_index`` (transformers 5.23) numbers tokens as Qwen2.5-VL's does,
so the code is ``qwen2_5_vl.positions``' (``mrope_position_ids``), fed the token types:

* text: the same id on the three axes, one more than the previous token's;
* an image of ``grid_thw = (1, h, w)`` patches: its ``(h/2) x (w/2)`` merged tokens in row-major order,
  token ``(i, j)`` at ``(start, start + i, start + j)``, ``start`` the id the next text token would have had;
* the text after an image goes on from ``start + max(h, w) / 2`` (the image's largest id + 1);
* a second image starts where the text before it leaves off; the spatial merge (2) divides the grid in both.

What differs from Qwen2.5-VL is elsewhere: how the ids turn into frequencies (Qwen3-VL interleaves the T/H/W
sections, ``mrope_interleaved``: the model's side), and videos (Qwen3-VL writes a timestamp and its own
``<|vision_start|>`` .. ``<|vision_end|>`` per temporal patch, so ``get_rope_index`` splits a video's grid into
frames of t = 1 with no time scaling; Qwen2.5-VL scales time by ``tokens_per_second``). ``position_ids`` here
takes images only (a token of type 2 is refused); videos: ``batch.qwen3_positions`` (the hf_logits inputs) and
the batcher (the reader's ``video_blocks``: one t = 1 block per temporal patch).

``get_rope_index`` finds an image as a run of type-1 tokens, so two images with no token between them would be
one run to it; the processor always puts ``<|vision_end|><|vision_start|>`` between, and so does the reader
(start and end tokens around each image block); ``mrope_position_ids`` tells such images apart by their grids.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omnibal_ext.errors import UserError

from megatron.vlm.lineages.qwen.positions import ImageTokenError, mrope_position_ids

__all__ = ["TEXT", "IMAGE", "VIDEO", "ImageTokenError", "mm_token_type_ids", "position_ids"]

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values


def mm_token_type_ids(token_ids, image_token_id: int, video_token_id: int | None = None) -> np.ndarray:
    """int64 array of ``token_ids``' shape: ``IMAGE`` where the id is ``image_token_id``, ``VIDEO`` where it is
    ``video_token_id`` (when given), ``TEXT`` elsewhere."""
    ids = np.asarray(token_ids)
    types = np.where(ids == image_token_id, IMAGE, TEXT).astype(np.int64)
    if video_token_id is not None:
        types[ids == video_token_id] = VIDEO
    return types


def position_ids(token_types, image_grids: Sequence[Sequence[int]], spatial_merge_size: int = 2,
                 where: str | None = None) -> tuple[np.ndarray, int]:
    """``int64 [3, seq]`` position ids (temporal, height, width) of one sample from its ``mm_token_type_ids``
    ``token_types [seq]`` and its images' ``grid_thw`` (patches, in order), and its ``mrope_position_delta``;
    refuses video tokens and placeholder runs that do not match the grids (``ImageTokenError``, ``where``
    such as ``file:line`` starting the message)."""
    types = np.asarray(token_types).reshape(-1)
    if (types == VIDEO).any():
        raise UserError(f"{where + ': ' if where else ''}video tokens (mm_token_type_ids 2): Qwen3-VL video input "
                        "is not implemented")
    return mrope_position_ids(types, image_grids, IMAGE, spatial_merge_size, where)
