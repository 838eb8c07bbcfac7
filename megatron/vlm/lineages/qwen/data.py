"""Qwen2.5-VL's data side (``FamilyRuntime.data``): images at native resolution, micro-batches with the ViT's
window fields and the LLM's 3-D multimodal RoPE ids.

Reading (``megatron/vlm/data/records.py`` with ``PatchImages`` as the image rule): an image of ``w x h`` px is
``smart_resize``d within the folder's ``min_pixels``..``max_pixels`` (``preprocessor_config.json`` of
``--hf-checkpoint``, else transformers' defaults; ``--min-pixels``/``--max-pixels`` override), becomes
``gh * gw`` patch rows (its ViT items, ``image_processing``) and ``<|vision_start|>`` + ``<|image_pad|>`` x
``gh * gw / 4`` + ``<|vision_end|>`` in the text; an aspect ratio over 200 is refused by the pre-training scan
with ``file:line``.  A video (``video.QwenFrames``) is one block of ``t*gh*gw`` patches, ``<|video_pad|>`` tokens
(the reader's ``mm_token_type_ids`` 2, its ``video_blocks`` the grid and ``second_per_grid_ts``), one ViT item of
the micro-batch in text order with the images.  A sample without images feeds the ViT nothing; a micro-batch without any image gets one
2 x 2-patch all-zero image whose single merged token no text token takes (the stage chain still runs the ViT).

Micro-batches (``QwenBatcher``): ``collate.py``'s fields (THD: one sample per row, or several packed in one row
with ``--omnibal-isf``), plus ``components.py``'s: ``mrope_position_ids [3, b, s]`` (each sample from 0, as
``get_rope_index`` numbers it; padding continues from 0 like text), and the images of all samples in one
``vision_windows`` call (``batch.vision_fields``: window permutation, window and image ``cu_seqlens``, 2-D
rotary ids, ``image_grid_thw``).  Stages get the ViT fields where they read pixels and the RoPE ids where
they read packing metadata.  Context parallelism: ``QwenBatcher.split_cp`` (whole images per CP rank).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from omnibal_ext.errors import UserError
from omnibal_ext.model.cp_split import image_runs
from omnibal_ext.model.sample_time import grid_vit_time_units

from .batch import IMAGE, VIDEO, QwenVision, vision_fields
from .image_processing import ImageProcessorConfig, preprocess_image, resized_grid
from .positions import mrope_position_ids, video_time_step
from .video import QwenFrames, check_geometry as check_video_geometry, settings as video_settings
from megatron.vlm.data.images import ImageRule, MediaOverrides
from megatron.vlm.layers.drop_path import image_patch_keys
from megatron.vlm.parallel.context_parallel import padded_layout, split_tokens
from megatron.vlm.stage.data_side import Batcher, DataSide
from megatron.vlm.stage.micro_batch import MicroBatch

IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # start, end, context
TOKEN_TYPES = "mm_token_type_ids"  # 0 text, 1 image, 2 video token (batch.IMAGE, batch.VIDEO)
VISION_KEYS = ("image_grid_thw", "vision_patch_index", "vision_merged_inverse", "vision_rotary_ids",
               "vision_cu_window_seqlens", "vision_max_window_seqlen", "vision_cu_seqlens", "vision_max_seqlen")


@dataclass(frozen=True)
class PatchImages(ImageRule):
    """Native resolution: an image's ViT items are its patches after ``smart_resize``."""

    processor: ImageProcessorConfig = ImageProcessorConfig()
    unit = "patches"

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``grid_thw`` (1, gh, gw) in patches of an image of ``width x height`` px."""
        return resized_grid(height, width, self.processor)

    def items(self, width, height, num_images):
        _, gh, gw = self.grid(width, height)
        return gh * gw

    def image_tokens(self, items):
        return items // self.processor.merge_size ** 2

    def pixels(self, image, num_images):
        rows, _ = preprocess_image(image, self.processor)
        return torch.from_numpy(rows)

    def dummy_pixels(self):
        return torch.zeros(0, self.processor.patch_dim)


def processor_config(media: MediaOverrides, hf_folder: str | None) -> ImageProcessorConfig:
    """The folder's image processor settings (else transformers' defaults) with --min-pixels/--max-pixels."""
    return with_pixel_flags(media, ImageProcessorConfig.from_folder(hf_folder) if hf_folder else ImageProcessorConfig())


def with_pixel_flags(media: MediaOverrides, config: ImageProcessorConfig) -> ImageProcessorConfig:
    """``config`` with the pixel budget of --min-pixels/--max-pixels where given (px)."""

    given = {k: v for k, v in (("min_pixels", media.min_pixels),
                               ("max_pixels", media.max_pixels)) if v is not None}
    try:
        return dataclasses.replace(config, **given)
    except UserError as e:
        raise UserError(f"--min-pixels/--max-pixels: {e}") from None


def image_rule(media: MediaOverrides, spec, hf_folder) -> PatchImages:
    """The reader's image rule (``DataSide.image_rule``): patches by the folder's processor settings."""
    return PatchImages(processor_config(media, hf_folder))


class QwenBatcher(Batcher):
    """``collate.py``'s micro-batch plus the ViT's window fields and the 3-D RoPE ids (module docstring).

    A family of the same data layout with other ViT fields (Qwen3-VL: no windows) overrides ``vision_fields`` and
    ``vision_part`` (``megatron.vlm.stage.micro_batch.VisionPart``: the fields it types, and which stages read them)."""

    vision_part = QwenVision

    def __init__(self, spec, image_token_id: int, rule: PatchImages):
        self.spec, self.image_token_id, self.rule = spec, image_token_id, rule
        self.merge = spec.vision.spatial_merge_size

    def make(self, samples, pad_id, packed, pad_to_multiple=1):
        batch = super().make(samples, pad_id, packed, pad_to_multiple)
        entries = [self._entries(sample) for sample in samples]  # per sample: (kind, grid, time step) per entry
        grids = [[g for _, g, _ in sample_entries] for sample_entries in entries]
        tokens = batch["tokens"]
        lengths = [len(s["input_ids"]) for s in samples]
        positions = np.empty((3, *tokens.shape), dtype=np.int64)
        types = np.zeros(tokens.shape, dtype=np.int64)
        members = list(zip(samples, lengths, entries))
        rows = [(0, members)] if packed else [(r, [m]) for r, m in enumerate(members)]
        for row, in_row in rows:
            start = 0
            for sample, n, sample_entries in in_row:
                given = sample.get("mm_token_type_ids")
                types[row, start:start + n] = (np.asarray(given) if given is not None else
                                               np.where(tokens[row, start:start + n].numpy() == self.image_token_id,
                                                        IMAGE, 0))
                positions[:, row, start:start + n], _ = mrope_position_ids(
                    types[row, start:start + n], [g for _, g, _ in sample_entries], (IMAGE, VIDEO), self.merge,
                    time_steps=[step for _, _, step in sample_entries])
                start += n
            positions[:, row, start:] = np.arange(tokens.shape[1] - start)
        batch["mrope_position_ids"] = torch.from_numpy(positions)
        batch["mm_token_type_ids"] = torch.from_numpy(types)
        every = [g for sample_grids in grids for g in sample_grids]
        kinds = [kind for sample_entries in entries for kind, _, _ in sample_entries]
        # drop path per image: each patch row keyed by (sample id, image index in the sample)
        # drop path per image and per video (a video's blocks share its key)
        batch["tile_keys"] = image_patch_keys(batch["sample_ids"].tolist(),
                                              [media_patches(sample) for sample in samples_entries(samples, entries)])
        if not every:  # the ViT still runs: one all-zero image of one merged token, taken by no text token
            every, kinds = [(1, self.merge, self.merge)], [IMAGE]
            batch["tile_keys"] = torch.zeros(self.merge ** 2, dtype=torch.int64)
            if "pixel_values" in batch:
                batch["pixel_values"] = torch.cat([batch["pixel_values"],
                                                   torch.zeros(self.merge ** 2, batch["pixel_values"].shape[1])])
        batch.update(self.vision_fields(every))
        batch["vision_item_types"] = torch.tensor(kinds, dtype=torch.int64)
        return batch

    def _entries(self, sample: dict) -> list[tuple[int, tuple[int, int, int], float | None]]:
        """``(kind, grid_thw, temporal id step)`` of each kept entry of ``sample`` in text order: an image's grid
        from its size; a video block's from the reader's ``video_blocks`` (``video.VideoBlock``), its step
        ``tokens_per_second * second_per_grid_ts`` where it has one."""
        blocks = sample.get("video_blocks") or [None] * len(sample["image_sizes"])
        out = []
        for k, block in enumerate(blocks):
            if block is None:
                out.append((IMAGE, self._grid(sample, k), None))
            else:
                step = None if block.second_per_grid_ts is None else video_time_step(
                    self.spec.vision.tokens_per_second, block.second_per_grid_ts)
                out.append((VIDEO, tuple(block.grid_thw), step))
        return out

    def vision_fields(self, grids: list[tuple[int, int, int]]) -> dict:
        """The ViT's host-built fields of the images ``grids`` (``grid_thw`` in patches) of one micro-batch."""
        return vision_fields(grids, self.spec)

    def _grid(self, sample: dict, k: int) -> tuple[int, int, int]:
        """``grid_thw`` of the sample's k-th kept image, from its size (what its pixel rows were made with)."""
        width, height = (int(x) for x in sample["image_sizes"][k])
        return self.rule.grid(width, height)

    def split_cp(self, batch, cp, rank, pad_id, img_context_id, sp_tp=1):
        """Context-parallel rank ``rank``'s part (``megatron/vlm/parallel/context_parallel.py``): the LLM tokens as every family
        splits them (``split_tokens``, ``image_feature_index`` over this family's image tokens) with
        ``mrope_position_ids [3, 1, t]`` in the padded, *unsplit* layout (megatron-core's THD RoPE takes this rank's
        chunks of per-token frequencies itself; pads: their position in the segment); the images go whole, in
        contiguous runs balanced by predicted ViT time (``image_runs`` of ``grid_vit_time_units``: a video's
        temporal patches each one attention segment): this rank's pixel rows and ``vision_fields`` (an
        all-zero 2 x 2-patch image whose output nobody reads when it has none), and ``vision_rank_tokens`` (every
        rank's merged image tokens, host ints: the LLM embedding's all-gather)."""
        out = split_tokens(batch, cp, rank, pad_id, None, sp_tp)
        if "mrope_position_ids" in batch and "cu_seqlens" in batch:
            src, pos = padded_layout(batch["cu_seqlens"].tolist(), cp, sp_tp)
            ids = batch["mrope_position_ids"].reshape(3, -1)[:, src.clamp(min=0)]
            out["mrope_position_ids"] = torch.where(src >= 0, ids, pos).reshape(3, 1, -1)
        if TOKEN_TYPES in batch and "cu_seqlens" in batch:
            # this rank's token types (pads: 0) and its vision tokens' ordinals among the micro-batch's (images'
            # and videos' tokens: where the gathered merged features go)
            src, _ = padded_layout(batch["cu_seqlens"].tolist(), cp, sp_tp, rank)
            flat = batch[TOKEN_TYPES].reshape(-1)
            real, take = src >= 0, src.clamp(min=0)
            out[TOKEN_TYPES] = torch.where(real, flat[take], torch.zeros_like(src)).reshape(1, -1)
            vision = flat > 0
            ordinal = torch.cumsum(vision.to(torch.int64), 0) - 1
            out["image_feature_index"] = ordinal[take][real & vision[take]]
        real = int(batch["sample_tiles"].sum()) > 0  # else the micro-batch's one image is make's dummy
        grids = [tuple(g) for g in batch["image_grid_thw"].tolist()] if real else []
        patches = [t * h * w for t, h, w in grids]
        runs = image_runs(grid_vit_time_units(self.spec, grids), cp)
        out["vision_rank_tokens"] = [sum(patches[i] for i in r) // self.merge ** 2 for r in runs]
        mine = runs[rank]
        first, last = sum(patches[:mine.start]), sum(patches[:mine.stop])
        if "pixel_values" in batch:
            pixels = batch["pixel_values"][first:last]
            out["pixel_values"] = pixels if len(mine) else torch.zeros(self.merge ** 2, pixels.shape[1])
        if "tile_keys" in batch:  # the drop path's keys of this rank's patches (the dummy image's: zeros)
            keys = batch["tile_keys"][first:last]
            out["tile_keys"] = keys if len(mine) else torch.zeros(self.merge ** 2, dtype=torch.int64)
        out.update(self.vision_fields(grids[mine.start:mine.stop] or [(1, self.merge, self.merge)]))
        return out


def samples_entries(samples, entries):
    """Per sample: ``(patches, starts a media item)`` per entry (an image, or a video's first block)."""
    out = []
    for sample, sample_entries in zip(samples, entries):
        blocks = sample.get("video_blocks") or [None] * len(sample_entries)
        out.append([(g[0] * g[1] * g[2], block is None or block.first)
                    for (_, g, _), block in zip(sample_entries, blocks)])
    return out


def media_patches(entries) -> list[int]:
    """Patch rows per media item (image or whole video) of one sample's ``samples_entries``."""
    out: list[int] = []
    for patches, starts in entries:
        if starts or not out:
            out.append(patches)
        else:
            out[-1] += patches
    return out


def profile_images(spec, shape) -> list[tuple[int, int]]:
    """Patch grids (rows, cols) of the images of a profiled micro-batch of ``shape.vision_items`` patches: one
    image, or ``vision_items^2 / vision_attn_tokens_sq`` images of equal size when the shape gives that sum,
    each the most nearly square grid of merged tokens (patches rounded down to whole merged tokens, at least
    one per image)."""
    m = spec.vision.spatial_merge_size
    n = shape.vision_items
    count = 1 if not shape.vision_attn_tokens_sq else max(1, round(n * n / shape.vision_attn_tokens_sq))
    merged = max(1, n // (m * m) // count)
    rows = max(r for r in range(1, int(merged ** 0.5) + 1) if merged % r == 0)
    return [(rows * m, merged // rows * m)] * count


def profile_batch(spec, shape, image_token_id: int, device, pad_to_multiple: int = 1,
                  batcher: type[QwenBatcher] = QwenBatcher) -> MicroBatch:
    """The micro-batch the trainer's profiler runs at ``shape``, made by ``batcher`` (a ``QwenBatcher``): the
    images of ``profile_images`` (random pixels; sizes their grids exactly, which ``smart_resize`` keeps) in the first
    sample, the ``shape.llm_tokens`` tokens cut into samples of ``attn_tokens_sq / llm_tokens`` (the first long
    enough for the images' tokens), packed in one row padded to a multiple of ``pad_to_multiple``; on ``device``
    (``MicroBatch.to``: the host-held fields stay)."""
    v = spec.vision
    m, p = v.spatial_merge_size, v.patch_size
    grids = profile_images(spec, shape)
    image_tokens = sum(r * c for r, c in grids) // (m * m)
    s = shape.llm_tokens
    if s < image_tokens + 2:
        raise UserError(f"profile shape: {s} LLM tokens cannot hold {sum(r * c for r, c in grids)} patches' "
                        f"{image_tokens} image tokens")
    g = torch.Generator().manual_seed(0)
    sample_len = max(1, round(shape.attn_tokens_sq / s))
    first = max(sample_len, image_tokens + 2)
    lengths = [first] + [sample_len] * ((s - first) // sample_len) + ([(s - first) % sample_len]
                                                                      if (s - first) % sample_len else [])
    patch_dim = v.in_channels * v.temporal_patch_size * p * p
    samples = []
    for k, n in enumerate(lengths):
        ids = torch.randint(0, 256, (n,), generator=g)
        ids[ids == image_token_id] = 0
        sample = {"input_ids": ids, "labels": torch.randint(0, 256, (n,), generator=g),
                  "image_flags": torch.zeros(0, dtype=torch.int64), "pixel_values": torch.zeros(0, patch_dim),
                  "image_sizes": torch.zeros(0, 2, dtype=torch.int64)}
        if k == 0:
            ids[1:1 + image_tokens] = image_token_id
            patches = sum(r * c for r, c in grids)
            sample.update(image_flags=torch.ones(patches, dtype=torch.int64),
                          pixel_values=torch.randn(patches, patch_dim, generator=g),
                          image_sizes=torch.tensor([(c * p, r * p) for r, c in grids], dtype=torch.int64))
        samples.append(sample)
    exact = ImageProcessorConfig(min_pixels=1, max_pixels=max(r * c for r, c in grids) * p * p, patch_size=p,
                                 temporal_patch_size=v.temporal_patch_size, merge_size=m)
    maker = batcher(spec, image_token_id, PatchImages(exact))
    return maker.micro_batch(maker.make(samples, 0, True, pad_to_multiple)).to(device)


def video_rule(media: MediaOverrides, spec, hf_folder) -> QwenFrames:
    """The reader's video rule (``DataSide.video_rule``): the folder's video processor settings with the
    ``--video-*`` flags, pixel values as its image processor (``preprocessor_config.json``) makes them."""
    return QwenFrames(check_video_geometry(video_settings(hf_folder, media.video), spec, hf_folder),
                      processor_config(media, hf_folder))


def digits_image_px(spec) -> int:
    """The built-in digits data's image side: 56 px (2 x 2 merged tokens of 14 px patches)."""
    return 56


QWEN_DATA = DataSide(image_tokens=IMAGE_TOKENS, image_rule=image_rule, batcher=QwenBatcher, video_rule=video_rule,
                     default_image_px=digits_image_px, profile_batch=profile_batch)
