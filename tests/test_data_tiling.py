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


# ---- against transformers' InternVL image processor (GotOcr2ImageProcessor with crop_to_patches) ----

@pytest.fixture(scope="module")
def hf_processor():
    """A factory of transformers' slow (PIL) GotOcr2 processor set up as InternVL's processor sets it:
    crop_to_patches (InternVLProcessor's default), square tiles, min_patches 1, ImageNet mean/std, bicubic,
    rescale 1/255, normalise, convert to RGB.  The slow one: its resize is PIL's bicubic, like ours (the
    fast one needs torchvision, which may be missing, and resizes with torch's bicubic)."""
    pytest.importorskip("transformers", reason="transformers not installed")
    got_ocr2 = pytest.importorskip("transformers.models.got_ocr2.image_processing_pil_got_ocr2",
                                   reason="this transformers has no PIL GotOcr2 image processor")

    def make(size, max_patches):
        return got_ocr2.GotOcr2ImageProcessorPil(
            crop_to_patches=True, size={"height": size, "width": size}, min_patches=1, max_patches=max_patches,
            image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD), resample=Image.Resampling.BICUBIC,
            do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
    return make


@pytest.mark.parametrize("w,h", [(448, 448), (1344, 448), (300, 1200), (20, 30), (1000, 700)],
                         ids=["square", "wide3to1", "tall1to4", "tiny20x30", "large1000x700"])
@pytest.mark.parametrize("max_num", [6, 12])
def test_pixel_values_match_transformers(hf_processor, w, h, max_num):
    rng = np.random.default_rng(w * 7 + h)
    img = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    ref = hf_processor(448, max_num)(images=[img], return_tensors="pt")
    ours = tiles_to_tensor(dynamic_tiles(img, 448, 1, max_num))
    assert ref["num_patches"].tolist() == [len(ours)] == [count_tiles(w, h, 448, 1, max_num)]
    assert ours.shape == ref["pixel_values"].shape and ours.dtype == ref["pixel_values"].dtype
    # same resize (PIL bicubic on uint8) and the same float32 arithmetic: bit for bit, tile by tile
    assert torch.equal(ours, ref["pixel_values"])


@pytest.mark.parametrize("mode", ["L", "P", "RGB"])
def test_pixel_values_match_transformers_small_tiles(hf_processor, mode):
    """The digits dataset's 32 px tiles, other image modes, and max 1 (no grid, no thumbnail)."""
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, size=(50, 130, 3), dtype=np.uint8)).convert(mode)
    for max_num in (1, 2, 6):
        ref = hf_processor(32, max_num)(images=[img], return_tensors="pt")["pixel_values"]
        assert torch.equal(tiles_to_tensor(dynamic_tiles(img, 32, 1, max_num)), ref), max_num


def test_tile_counts_match_transformers(hf_processor):
    """Grid choice, exact ties included (e.g. square images: (1,1) vs (2,2) vs (3,3)), over many sizes."""
    sides = [1, 14, 100, 224, 300, 447, 448, 449, 633, 634, 700, 896, 1000, 1344, 2000, 5000]
    for max_num in (1, 4, 6, 12):
        proc = hf_processor(448, max_num)
        for w, h in itertools.product(sides, sides):
            assert count_tiles(w, h, 448, 1, max_num) == proc.get_number_of_image_patches(h, w), (w, h, max_num)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P-transparency"])
def test_transparency_is_composited_on_white_as_transformers_does(hf_processor, mode):
    """An image with alpha (a half-transparent gradient over random colours) or a palette's transparent entry: the
    tiles equal transformers' processor on the same image (which composites it onto white)."""
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, size=(50, 130, 3), dtype=np.uint8)
    alpha = np.tile(np.linspace(0, 255, 130).astype(np.uint8), (50, 1))
    if mode == "P-transparency":
        img = Image.fromarray(rgb).convert("P")
        img.info["transparency"] = int(np.asarray(img)[0, 0])
    else:
        img = Image.fromarray(np.dstack([rgb, alpha])).convert(mode)
    ref = hf_processor(32, 6)(images=[img], return_tensors="pt")["pixel_values"]
    ours = tiles_to_tensor(dynamic_tiles(img, 32, 1, 6))
    assert torch.equal(ours, ref)
    hidden = Image.fromarray(np.asarray(img.convert("RGB")))  # the colours under the transparency, alone
    assert not torch.equal(tiles_to_tensor(dynamic_tiles(hidden, 32, 1, 6)), ref)


def test_a_16_bit_image_keeps_its_high_byte(hf_processor, tmp_path):
    """A 16-bit grayscale PNG trains as its 8-bit image of the high bytes (v >> 8, computed here in numpy), run
    through transformers' processor; PIL's own conversion, which the processor uses, clips it to white."""
    rng = np.random.default_rng(5)
    levels = rng.integers(0, 65536, size=(40, 90), dtype=np.uint16)
    Image.fromarray(levels).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as img:
        assert img.mode == "I;16"
        ours = tiles_to_tensor(dynamic_tiles(img, 32, 1, 6))
        clipped = hf_processor(32, 6)(images=[img], return_tensors="pt")["pixel_values"]
    high = Image.fromarray((levels >> 8).astype(np.uint8))
    assert torch.equal(ours, hf_processor(32, 6)(images=[high], return_tensors="pt")["pixel_values"])
    white = tiles_to_tensor([Image.new("RGB", (32, 32), (255, 255, 255))])[0]
    assert (clipped == white).float().mean() > 0.95 and (ours == white).float().mean() < 0.05


def test_32_bit_images_are_refused_by_the_scan(tmp_path):
    from megatron.vlm.data.records import decoded_size

    Image.fromarray(np.ones((8, 8), dtype=np.float32)).save(tmp_path / "float.tiff")
    with pytest.raises(ValueError, match=r"32-bit float pixels \(PIL mode F\) have no range to bring to 8 bits"):
        decoded_size(str(tmp_path / "float.tiff"))
