"""A model family's data side (``FamilyRuntime.data``): how its records become samples and micro-batches.

Every family reads the same formats (``records.py``: meta JSON or an annotation JSONL, ``conversations`` and
``messages`` records); what differs is

* ``image_tokens``: the strings of its image start, end and context (placeholder) tokens, which the tokenizer
  must know (``megatron.vlm.data.tokenizer.build_tokenizer``);
* ``image_rule(media, spec, hf_folder)``: its ``ImageRule`` (``images.py``), how the reader turns an image into
  ViT items and LLM image tokens; the rule's ``tokens_per_item`` serves the loader's image-token check (None:
  the batcher checks itself);
* ``video_rule(media, spec, hf_folder)``: its ``VideoRule`` (``video.py``: the frames it takes of a video, the text
  and image blocks they become, their pixels), from the ``--video-*`` flags (``media.video``) over the
  folder's video processor file; None (the default): no video rule, and the reader refuses video records.  Used
  only where the family declares ``Capabilities.video``;
* ``batcher(spec, image_token_id, rule)``: the picklable maker of micro-batches, a ``Batcher`` (its ``make``
  collates the samples into fields with the family's extra ones, ``rule`` being the reader's ``ImageRule``; its
  ``split_cp`` keeps a context-parallel rank's part of those fields; its ``vision_part``, the family's
  ``megatron.vlm.stage.micro_batch.VisionPart``, types them, and ``micro_batch`` makes a stage's ``MicroBatch`` of them);
* ``default_image_px(spec)``: the image side of the built-in digits data for this model;
* ``profile_batch(spec, shape, image_token_id, device, pad_to_multiple)``: the micro-batch the trainer's profiler
  (``megatron/training/profiling.py``) runs at a ``MicroBatchShape``, a ``MicroBatch`` made by its ``Batcher``
  (None: the profiler's own tiled one);
* ``side_rows(spec, batch, cp, cp_rank)``: the rows of a side tensor counting ``"image_tokens"``
  (``omnibal_ext.model.spec.SideTensor``) on this rank for ``batch``, from host-held fields only (``megatron/vlm/
  side.py``): the merged tokens of the vision items this CP rank's ViT runs.

``TILED`` (dynamic tiles, ``collate.py``'s fields) is ``FamilyRuntime``'s default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from omnibal_ext.model.shape import MicroBatchShape
from omnibal_ext.model.spec import ModelSpec

from megatron.vlm.parallel.context_parallel import split_batch, tile_ranges

from megatron.vlm.stage.micro_batch import MicroBatch, TileVision

from megatron.vlm.data.collate import collate_packed, collate_padded
from megatron.vlm.data.images import ImageRule, MediaOverrides, TileImages
from megatron.vlm.data.video import VideoRule
from megatron.vlm.data.tokenizer import IMG_CONTEXT, IMG_END, IMG_START


class Batcher:
    """Samples -> one micro-batch (``collate.py``'s schema, plus a family's fields); picklable (loader workers).

    ``make`` and ``split_cp`` work on the collated fields (a dict named by the schema); ``micro_batch`` makes the
    typed ``MicroBatch`` a stage reads of them, its vision part a ``vision_part``."""

    vision_part = TileVision

    def make(self, samples: list[dict], pad_id: int, packed: bool, pad_to_multiple: int = 1) -> dict:
        if packed:
            return collate_packed(samples, pad_id, pad_to_multiple=pad_to_multiple)
        return collate_padded(samples, pad_id, seq_length=None, pad_to_multiple=pad_to_multiple)

    def micro_batch(self, fields: dict, inputs=None) -> MicroBatch:
        """The ``MicroBatch`` a stage reading ``inputs`` (``megatron.vlm.stage.batches.StageInputs``; None: everything)
        gets of the collated (and split) ``fields``."""
        return MicroBatch.of(fields, self.vision_part, inputs)

    def split_cp(self, batch: dict, cp: int, rank: int, pad_id: int, img_context_id: int | None,
                 sp_tp: int = 1) -> dict:
        """Context-parallel rank ``rank``'s part of the micro-batch ``make`` built (``megatron/vlm/
        context_parallel.py``): the LLM tokens cut into 2 x CP chunks per segment, the tiles into contiguous runs."""
        return split_batch(batch, cp, rank, pad_id, img_context_id, sp_tp)


def tiled_images(media: MediaOverrides, spec, hf_folder: str | None) -> TileImages:
    """Dynamic tiles of the ViT's image size, ``spec.tokens_per_tile`` tokens each, --min/--max-num-tiles per image."""
    return TileImages(image_size=spec.vision.image_size, tokens_per_tile=spec.tokens_per_tile,
                      max_num_tiles=media.max_num_tiles, min_num_tiles=media.min_num_tiles)


def tiled_side_rows(spec, batch: MicroBatch, cp: int, cp_rank: int) -> int:
    """Image-token rows of a side tensor on this rank: every tile's (dummy tiles included, as the projector makes
    them) tokens per tile, of this CP rank's run of tiles under context parallelism (one tile when it has none:
    ``context_parallel.split_tiles``).  ``sample_tiles`` is held on the host (``collate.HOST_KEYS``)."""
    tiles = int(batch.samples.sample_tiles.sum())
    if cp > 1:
        tiles = max(len(tile_ranges(tiles, cp)[cp_rank]), 1)
    return tiles * spec.tokens_per_tile


def plain_batcher(spec: ModelSpec, image_token_id: int, rule: ImageRule) -> Batcher:
    """The tiled families' micro-batch maker: ``collate.py``'s fields."""
    return Batcher()


def vit_image_px(spec: ModelSpec) -> int:
    """The built-in digits data's image side for a tiled ViT: its tile size."""
    return spec.vision.image_size


class ImageRuleOf(Protocol):
    def __call__(self, media: MediaOverrides, spec: ModelSpec, hf_folder: str | None) -> ImageRule:
        """The reader's image rule for ``spec`` (the folder's processor settings under the run's flags)."""


class VideoRuleOf(Protocol):
    def __call__(self, media: MediaOverrides, spec: ModelSpec, hf_folder: str | None) -> VideoRule:
        """The reader's video rule for ``spec`` (the folder's video processor settings under the --video-* flags)."""


class BatcherOf(Protocol):
    def __call__(self, spec: ModelSpec, image_token_id: int, rule: ImageRule) -> Batcher:
        """The picklable micro-batch maker of ``spec``'s family."""


class ImagePx(Protocol):
    def __call__(self, spec: ModelSpec) -> int:
        """The built-in digits data's image side (px) for ``spec``."""


class ProfileBatch(Protocol):
    def __call__(self, spec: ModelSpec, shape: MicroBatchShape, image_token_id: int, device,
                 pad_to_multiple: int = 1) -> MicroBatch:
        """The micro-batch the trainer's profiler runs at ``shape``."""


class SideRows(Protocol):
    def __call__(self, spec: ModelSpec, batch: MicroBatch, cp: int, cp_rank: int) -> int:
        """Rows of an ``"image_tokens"`` side tensor on this rank for ``batch`` (host-held fields only)."""


@dataclass(frozen=True)
class DataSide:
    """See the module docstring."""

    image_tokens: tuple[str, str, str] = (IMG_START, IMG_END, IMG_CONTEXT)
    image_rule: ImageRuleOf = tiled_images
    video_rule: VideoRuleOf | None = None
    batcher: BatcherOf = plain_batcher
    default_image_px: ImagePx = vit_image_px
    profile_batch: ProfileBatch | None = None
    side_rows: SideRows = tiled_side_rows


TILED = DataSide()
