"""An image as the 8-bit RGB the ViT's preprocessing reads, for every family's image rule.

* transparency (an alpha band, or a palette's or grayscale image's transparent entry) is composited onto opaque
  white, as transformers' image processors do (``convert_to_rgb``);
* 16-bit grayscale (PIL modes ``I;16*``, e.g. a 16-bit PNG) keeps its high byte (``v >> 8``: 0..65535 onto 0..255,
  what PIL does for 16-bit RGB files); PIL's own conversion clips it at 255 (an all-white image for most files),
  which transformers' processors inherit;
* 32-bit integer and float images (modes ``I`` and ``F``) have no range to scale from: the pre-training scan
  refuses them, naming the file;
* every other mode goes through ``Image.convert("RGB")``.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
UNREAD_MODES = {"I": "32-bit integer", "F": "32-bit float"}


def mode_problem(mode: str) -> str | None:
    """Why an image of PIL mode ``mode`` is not read, or None."""
    if mode in UNREAD_MODES:
        return (f"{UNREAD_MODES[mode]} pixels (PIL mode {mode}) have no range to bring to 8 bits: save it as an "
                "8- or 16-bit image")
    return None


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in mode RGB (rules in the module docstring)."""
    if image.mode in SIXTEEN_BIT:
        image = Image.fromarray((np.asarray(image).astype(np.uint16) >> 8).astype(np.uint8))
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")
