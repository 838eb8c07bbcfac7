"""Qwen3-VL's data side (``FamilyRuntime.data``, ``QWEN3_VL_DATA``): Qwen2.5-VL's (``qwen2_5_vl.data``) with
Qwen3-VL's image settings, no ViT windows, and the token types the model reads.

Reading: an image of ``w x h`` px is ``smart_resize``d to multiples of 32 px within the folder's pixel budget
(``image_processing.folder_config``: ``preprocessor_config.json`` of ``--hf-checkpoint``, required; without a
folder, the published settings ``image_processing.PUBLISHED``, which the run says;
``--min-pixels``/``--max-pixels`` override the budget), becomes ``gh * gw`` patch rows of 1536 values (its ViT
items) and ``<|vision_start|>`` + ``<|image_pad|>`` x ``gh * gw / 4`` + ``<|vision_end|>`` in the text, rendered
with the folder's tokenizer and chat template (``megatron/vlm/data/tokenizer.py``, ``template.py``: the same
image tokens as Qwen2.5-VL). The folder's patch, merge and temporal patch sizes must be the model's.

Micro-batches (``Qwen3Batcher``, a ``QwenBatcher``): ``collate.py``'s fields, ``mrope_position_ids [3, b, s]``
(``positions``: each sample from 0, as ``get_rope_index`` numbers it), ``mm_token_type_ids [b, s]`` (int64, 1 on
``<|image_pad|>``, 0 elsewhere and on padding: the processor's field, given where tokens or packing metadata are
read, since DeepStack adds its features at the image tokens in the LLM layers), and the images' ViT fields
(``batch.vision_fields``: ``image_grid_thw [n, 3]``, 2-D rotary ids in processor order, the learned position
table's bilinear taps, one attention segment per image frame: full attention, no windows). A micro-batch
without images gets Qwen2.5-VL's dummy 2 x 2-patch image. Sequence parallelism pads the row to a multiple of TP
(``pad_to_multiple``; the pads are text, type 0). Context
parallelism (``Qwen3Batcher.split_cp``): Qwen2.5-VL's split (whole images per CP rank, balanced by patches; the
LLM tokens in 2 x CP chunks per segment), with ``mm_token_type_ids`` split like the tokens.

DeepStack features crossing pipeline stages: ``side_rows`` (their rows on the receiving stage, host fields only).

ISF: ``PatchImages`` gives each image's ViT items (patches) and grid, from which the reader's scan makes the
stats (``RecordDataset.sample_stats`` / ``image_grids``), as for Qwen2.5-VL.
"""
from __future__ import annotations

import functools

import torch

from omnibal_ext.errors import UserError

from .batch import Qwen3Vision, vision_fields
from .image_processing import PUBLISHED, folder_config
from .video import Qwen3Frames, settings as video_settings
from megatron.vlm.data.images import MediaOverrides
from megatron.vlm.lineages.qwen.data import (IMAGE_TOKENS, PatchImages, QwenBatcher,
                                             profile_batch as qwen_profile_batch, with_pixel_flags)
from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig
from megatron.vlm.lineages.qwen.video import check_geometry as check_video_geometry
from megatron.vlm.stage.data_side import DataSide
from megatron.vlm.stage.micro_batch import MicroBatch

VISION_KEYS = ("image_grid_thw", "vision_rotary_ids", "vision_pos_index", "vision_pos_weight", "vision_cu_seqlens",
               "vision_max_seqlen")
"""The fields ``batch.vision_fields`` makes (the ViT's, given where pixels are read)."""
TOKEN_TYPES = "mm_token_type_ids"


def check_geometry(config: ImageProcessorConfig, spec, where: str) -> None:
    """Refuse image processor settings whose patches the model's ViT cannot read (``where`` names their file)."""
    v = spec.vision
    for name, ours, model in (("patch_size", config.patch_size, v.patch_size),
                              ("merge_size", config.merge_size, v.spatial_merge_size),
                              ("temporal_patch_size", config.temporal_patch_size, v.temporal_patch_size)):
        if ours != model:
            raise UserError(f"{where}: {name} {ours}, but the model's ViT ({spec.name}) has {model}")


def processor_config(media: MediaOverrides, spec, hf_folder: str | None) -> ImageProcessorConfig:
    """The folder's image processor settings (required), or the published ones without a folder (said on rank 0),
    with --min-pixels/--max-pixels."""
    if hf_folder:
        config, where = folder_config(hf_folder)
    else:
        config, where = PUBLISHED, "the published Qwen3-VL image processor settings"
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"> Qwen3-VL images: no --hf-checkpoint folder, so {where}: patch {config.patch_size} px, "
                  f"mean/std {config.image_mean[0]}/{config.image_std[0]}, {config.min_pixels}..{config.max_pixels} "
                  "px per image (--min-pixels/--max-pixels change the budget)", flush=True)
    check_geometry(config, spec, where)
    return with_pixel_flags(media, config)


def image_rule(media: MediaOverrides, spec, hf_folder) -> PatchImages:
    """The reader's image rule (``DataSide.image_rule``): patches by ``processor_config``."""
    return PatchImages(processor_config(media, spec, hf_folder))


class Qwen3Batcher(QwenBatcher):
    """Qwen2.5-VL's micro-batch with Qwen3-VL's ViT fields and ``mm_token_type_ids`` (module docstring)."""

    vision_part = Qwen3Vision

    def vision_fields(self, grids):
        return vision_fields(grids, self.spec)



def side_rows(spec, batch: MicroBatch, cp: int, cp_rank: int) -> int:
    """Rows of a DeepStack feature (``DataSide.side_rows``, ``megatron/vlm/stage/side.py``) on this rank, from host-held
    fields: the merged tokens of the images this (CP) rank's ViT runs -- of ``vision_cu_seqlens`` (the patches,
    the dummy image's included) on a stage that runs ViT layers; else ``vision_rank_tokens`` under context
    parallelism (one token for a rank without images: its dummy image's); else the micro-batch's patches
    (``sample_tiles``; one token for the dummy image of a micro-batch without any)."""
    merge_unit = spec.vision.spatial_merge_size ** 2
    if batch.vision.vision_cu_seqlens is not None:
        return int(batch.vision.vision_cu_seqlens[-1]) // merge_unit
    if cp > 1:
        if batch.cp is None or batch.cp.vision_rank_tokens is None:
            raise ValueError("Qwen3-VL side tensor rows under context parallelism: the stage reads neither pixels "
                             "nor tokens (no vision_cu_seqlens, no vision_rank_tokens)")
        return max(int(batch.cp.vision_rank_tokens[cp_rank]), 1)
    return max(int(batch.samples.sample_tiles.sum()) // merge_unit, 1)


profile_batch = functools.partial(qwen_profile_batch, batcher=Qwen3Batcher)
"""The trainer profiler's micro-batch (``qwen2_5_vl.data.profile_batch``) made by ``Qwen3Batcher``."""

def video_rule(media: MediaOverrides, spec, hf_folder) -> Qwen3Frames:
    """The reader's video rule (``DataSide.video_rule``): the folder's video processor settings with the
    ``--video-*`` flags, pixel values as its image processor makes them."""
    return Qwen3Frames(check_video_geometry(video_settings(hf_folder, media.video), spec, hf_folder),
                       processor_config(media, spec, hf_folder))


def digits_image_px(spec) -> int:
    """The built-in digits data's image side: 4 patches (2 x 2 merged tokens)."""
    return 4 * spec.vision.patch_size


QWEN3_VL_DATA = DataSide(image_tokens=IMAGE_TOKENS, image_rule=image_rule, batcher=Qwen3Batcher, video_rule=video_rule,
                         default_image_px=digits_image_px, profile_batch=profile_batch,
                         side_rows=side_rows)

__all__ = ["QWEN3_VL_DATA", "Qwen3Batcher", "VISION_KEYS", "check_geometry", "image_rule", "processor_config",
           "side_rows", "vision_fields"]
