"""Dynamic tiling: grid choice against a brute force, tile counts, tile contents and normalisation."""
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from megatron.vlm.data import (IMAGENET_MEAN, IMAGENET_STD, black_tile_tensor, choose_grid, count_tiles,
                               dynamic_tiles, tiles_to_tensor)


def brute_force_grid(w, h, size, min_num, max_num):
    """Closed form of InternVL's rule: among the grids whose aspect is closest to w/h (ordered by area,
    then columns), the last one whose pixel area is below 2*w*h, else the first one."""
    grids = [(c, r) for c in range(1, max_num + 1) for r in range(1, max_num + 1) if min_num <= c * r <= max_num]
    diffs = {g: abs(w / h - g[0] / g[1]) for g in grids}
    best = min(diffs.values())
    tied = sorted((g for g in grids if diffs[g] == best), key=lambda g: (g[0] * g[1], g[0]))
    later_ok = [g for g in tied[1:] if w * h > 0.5 * size * size * g[0] * g[1]]
    return later_ok[-1] if later_ok else tied[0]


@pytest.mark.parametrize("max_num", [1, 2, 4, 6, 12])
def test_grid_choice_matches_brute_force(max_num):
    size = 32
    sides = [1, 7, 16, 20, 23, 32, 45, 46, 64, 65, 90, 96, 130, 200, 333]
    for w, h in itertools.product(sides, sides):
        assert choose_grid(w, h, size, 1, max_num) == brute_force_grid(w, h, size, 1, max_num), (w, h)


def test_known_grids():
    assert choose_grid(448, 448, 448, 1, 6) == (1, 1)
    assert choose_grid(1000, 1000, 448, 1, 6) == (2, 2)  # tie (1,1)/(2,2): area 1e6 > 0.5*448^2*4
    assert choose_grid(600, 600, 448, 1, 6) == (1, 1)  # 3.6e5 < 4.0e5
    assert choose_grid(96, 32, 32, 1, 6) == (3, 1)
    assert choose_grid(32, 96, 32, 1, 6) == (1, 3)
    assert choose_grid(3000, 100, 448, 1, 6) == (6, 1)
    assert count_tiles(96, 32, 32, 1, 6) == 4 and count_tiles(96, 32, 32, 1, 6, use_thumbnail=False) == 3
    assert count_tiles(20, 20, 32, 1, 6) == 1  # one tile never gets a thumbnail


def test_count_tiles_equals_tiles_made():
    rng = np.random.default_rng(0)
    for _ in range(40):
        w, h = (int(v) for v in rng.integers(5, 200, size=2))
        max_num = int(rng.integers(1, 9))
        thumb = bool(rng.integers(2))
        img = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
        tiles = dynamic_tiles(img, 32, 1, max_num, thumb)
        assert len(tiles) == count_tiles(w, h, 32, 1, max_num, thumb)
        assert all(t.size == (32, 32) and t.mode == "RGB" for t in tiles)


def test_tiles_are_row_major_and_thumbnail_last():
    size, cols, rows = 8, 3, 2
    colors = np.arange(cols * rows, dtype=np.uint8).reshape(rows, cols) * 40  # distinct grey per tile
    pixels = np.kron(colors, np.ones((size, size), np.uint8))  # image already at the grid's size
    img = Image.fromarray(pixels).convert("RGB")
    assert choose_grid(cols * size, rows * size, size, 1, 6) == (cols, rows)
    tiles = dynamic_tiles(img, size, 1, 6, True)
    assert len(tiles) == cols * rows + 1
    for k, tile in enumerate(tiles[:-1]):
        arr = np.asarray(tile)
        assert (arr == colors[k // cols, k % cols]).all()
    assert np.array_equal(np.asarray(tiles[-1]), np.asarray(img.resize((size, size), Image.Resampling.BICUBIC)))


def test_tiles_to_tensor_normalises():
    white = Image.new("RGB", (4, 4), (255, 255, 255))
    red = Image.new("RGB", (4, 4), (255, 0, 0))
    x = tiles_to_tensor([white, red])
    assert x.shape == (2, 3, 4, 4) and x.dtype == torch.float32
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    assert torch.allclose(x[0, :, 1, 2], (1 - mean) / std)
    assert torch.allclose(x[1, :, 0, 0], (torch.tensor([1.0, 0, 0]) - mean) / std)
    black = black_tile_tensor(4)
    assert black.shape == (1, 3, 4, 4)
    assert torch.allclose(black, tiles_to_tensor([Image.new("RGB", (4, 4))]))
