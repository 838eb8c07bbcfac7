"""Qwen2.5-VL image preprocessing: one PIL image -> flattened patch rows and its ``grid_thw``.

The result is bit-identical to the Hugging Face PIL image processor of Qwen2-VL / Qwen2.5-VL
(``Qwen2VLImageProcessorPil``), step by step:

1. RGB (``megatron/vlm/data/rgb.py``): an image with an alpha band (or a palette/"transparency" entry) is
   composited onto opaque white, every other mode is converted with ``Image.convert("RGB")``, except 16-bit
   grayscale, which keeps its high byte (the reference clips it at 255).  No EXIF rotation (the reference applies
   none).
2. Resize to ``smart_resize(height, width)`` (both sides multiples of ``patch_size * merge_size`` px, the
   area kept within ``[min_pixels, max_pixels]``) with PIL's resampling filter ``resample`` (bicubic).
   The image is resized even when the size does not change (PIL then returns a copy).
3. Rescale: uint8 -> float64 times ``rescale_factor`` (1/255), then cast to float32.
4. Normalize per channel in float32: ``(x - mean) / std``.
5. Patchify: the ``C x H x W`` image (``H = gh*p``, ``W = gw*p``, ``p = patch_size``) becomes
   ``gh*gw`` rows of ``C * temporal_patch_size * p * p`` values.  Rows are ordered by 2x2 merge groups
   (``merge_size`` m): merged row ``i < gh/m``, merged column ``j < gw/m``, then the m x m patches of that group
   row-major, so the m*m patches of one LLM token are consecutive.  Within a row the values are ordered
   ``(channel, frame, y, x)``; a still image is repeated over the ``temporal_patch_size`` frames (2 identical
   copies), which is the input layout of the vision tower's Conv3d patch embedding.

``grid_thw`` is ``(1, gh, gw)`` in patches; the image becomes ``gh*gw // m**2`` LLM tokens.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

from omnibal_ext.errors import UserError

from megatron.vlm.data.rgb import to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # longer side / shorter side, refused above

PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # newer folders may nest the image processor's dict in it


class ImageSizeError(UserError):
    """An image whose size the Qwen2.5-VL preprocessing cannot handle (empty, or too elongated)."""


def _prefix(where: str | None) -> str:
    return f"{where}: " if where else ""


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280, where: str | None = None) -> tuple[int, int]:
    """The ``(height, width)`` in px an image of ``height x width`` px is resized to.

    Both results are multiples of ``factor`` px (patch size x merge size, 28).  Each side is first rounded to
    the nearest multiple (Python ``round``: halves to even).  If that area exceeds ``max_pixels`` px, both sides
    are scaled by ``sqrt(max_pixels / area)`` of the original and rounded *down* to a multiple (at least
    ``factor``); if it is below ``min_pixels`` px, both are scaled by ``sqrt(min_pixels / area)`` and rounded
    *up*.  The aspect ratio is thus kept as closely as the grid allows.

    Refuses (``ImageSizeError``, a ``UserError``, its message starting with ``where`` such as ``file:line``
    when given) an empty image and one whose longer side is more than 200 times its shorter side.
    """
    if height <= 0 or width <= 0:
        raise ImageSizeError(f"{_prefix(where)}image of {width}x{height} px (width x height) is empty")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"{_prefix(where)}image of {width}x{height} px (width x height) has an aspect ratio "
                             f"of {ratio:.1f}; the Qwen-VL image processors accept at most {MAX_ASPECT_RATIO}")
    new_h = factor * round(height / factor)
    new_w = factor * round(width / factor)
    if new_h * new_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_h = max(factor, factor * math.floor(height / shrink / factor))
        new_w = max(factor, factor * math.floor(width / shrink / factor))
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = factor * math.ceil(height * grow / factor)
        new_w = factor * math.ceil(width * grow / factor)
    return new_h, new_w


@dataclass(frozen=True)
class ImageProcessorConfig:
    """What the preprocessing reads from a model folder; the defaults are the reference class's own.

    Sizes: ``min_pixels``/``max_pixels`` are areas in px (height x width after resizing), ``patch_size`` px per
    patch side, ``temporal_patch_size`` frames per patch, ``merge_size`` patches per side of one LLM token.
    ``resample`` is a PIL filter number (3: bicubic).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"image processor: {name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise UserError(f"image processor: min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
                raise UserError(f"image processor: {name} must hold 3 numbers (R, G, B), got {value!r}")
        if any(v == 0 for v in self.image_std):
            raise UserError(f"image processor: image_std has a zero: {self.image_std}")

    @property
    def factor(self) -> int:
        """Side of one LLM token's square in px (patch_size x merge_size, 28)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values in one patch row: 3 channels x temporal_patch_size x patch_size**2 (1176)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, d: dict, where: str = "image processor config") -> "ImageProcessorConfig":
        """Read a ``preprocessor_config.json`` dict the way the reference class's constructor does.

        The pixel limits come from ``size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}`` (newer
        files), overridden key by key by top-level ``min_pixels`` / ``max_pixels`` when present and not null (older
        files carry only these).  Missing keys keep the defaults.  Switching a step off (``do_resize``,
        ``do_rescale``, ``do_normalize``, ``do_convert_rgb`` false) is refused: not implemented here.
        """
        if not isinstance(d, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(d).__name__}")
        kwargs: dict = {}
        size = d.get("size")
        if size is not None:
            if not isinstance(size, dict) or not set(size) <= {"shortest_edge", "longest_edge"}:
                raise UserError(f"{where}: size must be {{'shortest_edge': min_pixels, 'longest_edge': max_pixels}},"
                                f" got {size!r}")
            if "shortest_edge" in size:
                kwargs["min_pixels"] = size["shortest_edge"]
            if "longest_edge" in size:
                kwargs["max_pixels"] = size["longest_edge"]
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                    "rescale_factor", "resample"):
            if d.get(key) is not None:
                kwargs[key] = d[key]
        for key in ("image_mean", "image_std"):
            value = d.get(key)
            if value is None:
                continue
            kwargs[key] = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(value)
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if d.get(key) is False:
                raise UserError(f"{where}: {key} = false is not implemented (the Qwen2.5-VL preprocessing "
                                "always resizes, rescales, normalizes and converts to RGB)")
        if not isinstance(kwargs.get("rescale_factor", 1.0), (int, float)):
            raise UserError(f"{where}: rescale_factor must be a number, got {kwargs['rescale_factor']!r}")
        if kwargs.get("resample", 3) not in {int(r) for r in Image.Resampling}:
            raise UserError(f"{where}: resample must be a PIL filter number, got {kwargs['resample']!r}")
        try:
            return cls(**kwargs)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None

    @classmethod
    def from_folder(cls, folder: str) -> "ImageProcessorConfig":
        """The config of a Hugging Face model folder (``folder_processor_dict``), else the defaults (a folder
        without either file)."""
        found = folder_processor_dict(folder)
        return cls() if found is None else cls.from_dict(*found)


def folder_processor_dict(folder: str) -> tuple[dict, str] | None:
    """(the image processor's settings, where they were read) of a Hugging Face model folder, found as transformers
    finds them: the ``image_processor`` entry of ``processor_config.json`` when that file has one, else
    ``preprocessor_config.json``; None when the folder has neither."""
    nested = os.path.join(folder, PROCESSOR_FILE)
    if os.path.isfile(nested):
        d = _read_json(nested)
        if isinstance(d, dict) and "image_processor" in d:
            return d["image_processor"], f"{nested}: image_processor"
    path = os.path.join(folder, PREPROCESSOR_FILE)
    if os.path.isfile(path):
        return _read_json(path), path
    return None


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None


def resized_grid(height: int, width: int, config: ImageProcessorConfig = ImageProcessorConfig(),
                 where: str | None = None) -> tuple[int, int, int]:
    """``grid_thw`` ``(1, gh, gw)`` in patches of an image of ``height x width`` px, without decoding it."""
    h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels, where)
    return 1, h // config.patch_size, w // config.patch_size


def patchify(image: np.ndarray, patch_size: int = 14, merge_size: int = 2,
             temporal_patch_size: int = 2) -> np.ndarray:
    """Rows ``[gh*gw, C*T*p*p]`` of a still ``C x H x W`` image (``H = gh*p``, ``W = gw*p``; gh and gw multiples
    of ``merge_size``): row order merge group (row, column), then patch within the group row-major; values
    within a row ``(channel, frame, y, x)``, the image repeated over ``T = temporal_patch_size`` frames."""
    c, height, width = image.shape
    p, m = patch_size, merge_size
    gh, gw = height // p, width // p
    if gh * p != height or gw * p != width or gh % m or gw % m:
        raise ValueError(f"patchify: {height}x{width} px is not a grid of {m}x{m} groups of {p} px patches")
    # axes: c, group row, row in group, y, group col, col in group, x
    blocks = image.reshape(c, gh // m, m, p, gw // m, m, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # group row, group col, row in group, col in group, c, y, x
    frames = np.repeat(blocks[:, :, :, :, :, np.newaxis], temporal_patch_size, axis=5)  # c, frame, y, x
    return np.ascontiguousarray(frames).reshape(gh * gw, c * temporal_patch_size * p * p)


def preprocess_image(image: Image.Image, config: ImageProcessorConfig = ImageProcessorConfig(),
                     where: str | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One PIL image -> (float32 patch rows ``[gh*gw, 3*T*p*p]``, ``grid_thw`` ``(1, gh, gw)``).

    ``where`` (e.g. ``file:line``) starts the message of a refused image (see ``smart_resize``).
    """
    rgb = to_rgb(image)
    height, width = rgb.height, rgb.width
    new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels, where)
    resized = rgb.resize((new_w, new_h), resample=config.resample)
    pixels = np.asarray(resized).transpose(2, 0, 1)  # C, H, W uint8
    scaled = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(config.image_std, dtype=np.float32).reshape(3, 1, 1)
    normalized = (scaled - mean) / std
    rows = patchify(normalized, config.patch_size, config.merge_size, config.temporal_patch_size)
    return rows, (1, new_h // config.patch_size, new_w // config.patch_size)
