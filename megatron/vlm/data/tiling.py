"""Dynamic tiling: cut an image into a grid of square tiles (+ a thumbnail) of side ``size`` px.

Grid choice for an image of ``w x h`` px: among all grids ``(cols, rows)`` with ``min_num <= cols*rows <=
max_num``, visited in order of increasing area (ties of area by increasing ``cols``), keep the one whose
aspect ratio ``cols/rows`` is closest to ``w/h``; on an exact tie a later (larger) grid replaces the kept
one when the image area ``w*h`` exceeds half of that grid's pixel area ``0.5 * size^2 * cols*rows``
(the published rule).  The image is resized to ``(cols*size, rows*size)`` and cut row-major into
``cols*rows`` tiles; when that is more than one tile and ``use_thumbnail``, the whole image resized to
``size x size`` is appended as a last tile.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from .rgb import to_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@lru_cache(maxsize=64)
def candidate_grids(min_num: int, max_num: int) -> tuple[tuple[int, int], ...]:
    """All ``(cols, rows)`` with ``min_num <= cols*rows <= max_num``, by increasing area then cols."""
    if min_num < 1 or max_num < min_num:
        raise ValueError(f"tiling: need 1 <= min_num <= max_num, got min_num={min_num}, max_num={max_num}")
    grids = [(c, r) for c in range(1, max_num + 1) for r in range(1, max_num + 1) if min_num <= c * r <= max_num]
    return tuple(sorted(grids, key=lambda g: (g[0] * g[1], g[0])))


def choose_grid(width: int, height: int, size: int, min_num: int = 1, max_num: int = 6) -> tuple[int, int]:
    """The ``(cols, rows)`` grid for a ``width x height`` px image (rule in the module docstring)."""
    if width < 1 or height < 1:
        raise ValueError(f"tiling: image size must be positive, got {width}x{height}")
    aspect = width / height
    area = width * height
    best, best_diff = None, float("inf")
    for cols, rows in candidate_grids(min_num, max_num):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * size * size * cols * rows:
            best = (cols, rows)
    return best


def count_tiles(width: int, height: int, size: int, min_num: int = 1, max_num: int = 6,
                use_thumbnail: bool = True) -> int:
    """Tiles ``dynamic_tiles`` makes for a ``width x height`` image, without touching pixels."""
    cols, rows = choose_grid(width, height, size, min_num, max_num)
    n = cols * rows
    return n + 1 if (n > 1 and use_thumbnail) else n


def dynamic_tiles(image: Image.Image, size: int, min_num: int = 1, max_num: int = 6,
                  use_thumbnail: bool = True) -> list[Image.Image]:
    """The tiles (RGB PIL images of ``size x size``) of ``image`` (made RGB by ``rgb.to_rgb``), row-major,
    thumbnail last."""
    image = to_rgb(image)
    width, height = image.size
    cols, rows = choose_grid(width, height, size, min_num, max_num)
    resized = image.resize((cols * size, rows * size), Image.Resampling.BICUBIC)
    tiles = []
    for k in range(cols * rows):
        x, y = (k % cols) * size, (k // cols) * size
        tiles.append(resized.crop((x, y, x + size, y + size)))
    if len(tiles) > 1 and use_thumbnail:
        tiles.append(image.resize((size, size), Image.Resampling.BICUBIC))
    return tiles


@lru_cache(maxsize=8)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Float32 ``[3, 256]``: the normalised value of every 8-bit level of every channel, computed in the
    order the published processors use (``v * (1/255)`` in float64 rounded to float32, then ``(x - mean) / std``
    in float32), so a table look-up gives the same bits as rescaling and normalising each pixel."""
    levels = (np.arange(256, dtype=np.float64) * (1.0 / 255.0)).astype(np.float32)
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    return torch.from_numpy(((levels[None, :] - m[:, None]) / s[:, None]).astype(np.float32))


def tiles_to_tensor(tiles: list[Image.Image], mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """Float32 ``[k, 3, size, size]``: pixels rescaled by 1/255, then ``(x - mean) / std`` per channel."""
    if not tiles:
        raise ValueError("tiles_to_tensor: no tiles")
    pixels = torch.from_numpy(np.stack([np.asarray(t.convert("RGB"), dtype=np.uint8) for t in tiles]))
    pixels = pixels.permute(0, 3, 1, 2).to(torch.int64)  # [k, 3, S, S] levels 0..255
    table = _normalise_table(tuple(mean), tuple(std))
    return torch.stack([table[c][pixels[:, c]] for c in range(3)], dim=1)


def black_tile_tensor(size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """The normalised all-black ``[1, 3, size, size]`` tile given to text-only samples (image_flags 0)."""
    black = _normalise_table(tuple(mean), tuple(std))[:, 0]
    return black[None, :, None, None].expand(1, 3, size, size).contiguous()
