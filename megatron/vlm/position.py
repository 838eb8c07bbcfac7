"""Position-embedding tables of the ViT at another tile size (used when loading a checkpoint)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def resize_position_embedding(table: torch.Tensor, image_size: int, patch_size: int) -> torch.Tensor:
    """A learned ViT position table [1, 1 + P, H] (class token first, then a square grid of P patches in
    row-major order) resized to the patch grid of ``image_size`` / ``patch_size`` tiles.

    The class token's row is kept; the patch rows are read as an image of H channels and resized
    bicubically (``align_corners=False``, computed in fp32, returned in the table's dtype). A checkpoint
    trained at 448 px with patch 14 (32 x 32 grid) thus loads into a run with other tiles.
    """
    if table.dim() != 3 or table.shape[0] != 1:
        raise ValueError(f"resize_position_embedding: expected a [1, 1 + P, H] table, got {tuple(table.shape)}")
    if image_size % patch_size:
        raise ValueError(f"resize_position_embedding: patch {patch_size} does not divide image {image_size}")
    patches, hidden = table.shape[1] - 1, table.shape[2]
    grid = math.isqrt(patches)
    if grid * grid != patches:
        raise ValueError(f"resize_position_embedding: {patches} patch rows are not a square grid")
    new_grid = image_size // patch_size
    if new_grid == grid:
        return table.clone()
    cls, patch = table[:, :1], table[:, 1:]
    img = patch.float().reshape(1, grid, grid, hidden).permute(0, 3, 1, 2)  # [1, H, g, g]
    img = F.interpolate(img, size=(new_grid, new_grid), mode="bicubic", align_corners=False)
    patch = img.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid, hidden).to(table.dtype)
    return torch.cat([cls, patch], dim=1)
