"""Image rules: how the reader (``records.py``) turns an image into ViT items and LLM image tokens.

A family's data side gives its rule (``DataSide.image_rule``); the reader asks it, for each image, how many ViT
items the image is (from its size alone, in the validation scan), how many LLM image tokens those become, and the
pixels (when a sample is loaded). A sample holds what the rule produced: its pixel rows (``pixel_values``), one
``image_flags`` entry per item and each image's size (from which a rule of patch grids gives the grid).

``TileImages`` is dynamic tiling (``tiling.py``): fixed-size square tiles plus a thumbnail, a fixed number of
image tokens per tile. A family with another rule (native-resolution patches, say) defines its own ``ImageRule``
in its folder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from omnibal_ext.errors import UserError

from .tiling import black_tile_tensor, count_tiles, dynamic_tiles, tiles_to_tensor
from .video_sampling import VideoOverrides


@dataclass(frozen=True)
class MediaOverrides:
    """The image and video flags of a run, as the families' rules read them (``DataSide.image_rule`` /
    ``video_rule``); None: not given (the folder's processor file, else the family's default).

    ``max_num_tiles`` / ``min_num_tiles``: tiles per image of a tiled family, thumbnail excluded
    (``--max-num-tiles`` / ``--min-num-tiles``); ``min_pixels`` / ``max_pixels``: the area (px, height x width)
    a native-resolution image is resized within (``--min-pixels`` / ``--max-pixels``); ``video``: the
    ``--video-*`` flags.
    """

    max_num_tiles: int = 6
    min_num_tiles: int = 1
    min_pixels: int | None = None
    max_pixels: int | None = None
    video: VideoOverrides = VideoOverrides()


class ImageRule:
    """How a family's reader turns an image into ViT items and LLM image tokens (``ReaderConfig.images``).

    ``items(width, height, num_images)``: ViT items of an image of that size (px) in a record of ``num_images``
    images (raises a ``UserError`` for a size the family refuses); ``image_tokens(items)``: the LLM tokens between
    the image's start and end tokens; ``pixels(image, num_images)``: its float32 ViT input, ``items`` rows;
    ``dummy_items`` / ``dummy_pixels()``: what a sample without images feeds the ViT (``image_flags`` 0);
    ``tokens_per_item``: image tokens per item when that is fixed (the loader checks each micro-batch's image
    tokens against it), None where items vary (the family's batcher checks).
    """

    dummy_items: int = 0
    unit: str = "items"  # what an item is, for stats ("tiles", "patches")
    tokens_per_item: int | None = None

    def items(self, width: int, height: int, num_images: int) -> int:
        raise NotImplementedError

    def image_tokens(self, items: int) -> int:
        raise NotImplementedError

    def pixels(self, image: Image.Image, num_images: int) -> torch.Tensor:
        raise NotImplementedError

    def dummy_pixels(self) -> torch.Tensor:
        raise NotImplementedError

    def grid(self, width: int, height: int) -> tuple[int, int, int] | None:
        """``(t, rows, cols)`` patches of an image of that size when its items are a patch grid, else None."""
        return None


@dataclass(frozen=True)
class TileImages(ImageRule):
    """Dynamic tiling: items are square tiles of ``image_size`` px (thumbnail included), each ``tokens_per_tile``
    image tokens; a sample without images feeds one black tile.

    Tiles per image: ``min_num_tiles..max_num_tiles`` (``--min-num-tiles``/``--max-num-tiles``), thumbnail
    excluded. Multi-image records: each image may use ``max(1, max_num_tiles // num_images)`` tiles; when that is
    below ``min_num_tiles`` no grid is allowed and the image becomes one tile."""

    image_size: int  # tile side, px
    tokens_per_tile: int  # image-context tokens per tile
    max_num_tiles: int  # tiles per image (before the multi-image split), thumbnail excluded
    min_num_tiles: int = 1
    use_thumbnail: bool = True

    dummy_items = 1
    unit = "tiles"

    def __post_init__(self) -> None:
        if not 1 <= self.min_num_tiles <= self.max_num_tiles:
            raise UserError(f"tiles per image: need 1 <= min_num_tiles <= max_num_tiles, got "
                            f"min {self.min_num_tiles}, max {self.max_num_tiles}")

    @property
    def tokens_per_item(self) -> int:
        return self.tokens_per_tile

    def tiles_per_image_limit(self, num_images: int) -> int:
        return max(1, self.max_num_tiles // max(1, num_images))

    def tile_range(self, num_images: int) -> tuple[int, int]:
        """(min, max) tiles of each image of a record with ``num_images`` images; (1, 1) when the
        multi-image split leaves fewer than ``min_num_tiles`` (one tile then)."""
        limit = self.tiles_per_image_limit(num_images)
        return (self.min_num_tiles, limit) if self.min_num_tiles <= limit else (1, 1)

    def items(self, width, height, num_images):
        lo, hi = self.tile_range(num_images)
        return count_tiles(width, height, self.image_size, lo, hi, self.use_thumbnail)

    def image_tokens(self, items):
        return items * self.tokens_per_tile

    def pixels(self, image, num_images):
        lo, hi = self.tile_range(num_images)
        return tiles_to_tensor(dynamic_tiles(image, self.image_size, lo, hi, self.use_thumbnail))

    def dummy_pixels(self):
        return black_tile_tensor(self.image_size)
