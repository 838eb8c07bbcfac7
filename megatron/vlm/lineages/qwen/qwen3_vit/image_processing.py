"""Qwen3-VL image preprocessing: Qwen2.5-VL's steps with Qwen3-VL's settings.

transformers maps ``qwen3_vl`` to ``Qwen2VLImageProcessorPil``, the processor of Qwen2-VL and Qwen2.5-VL, so the
steps are ``qwen2_5_vl.image_processing``'s (RGB on white, ``smart_resize``, bicubic resize, rescale, normalize,
patchify in 2 x 2 merge-group order, a still image repeated over the 2 frames of a temporal patch) and so is the
code. What differs is the settings, which the folder's ``preprocessor_config.json`` carries:

* patch 16 px (the image's sides are multiples of ``patch_size x merge_size`` = 32 px), so a patch row holds
  3 x 2 x 16 x 16 = 1536 values;
* mean and std 0.5 per channel (pixels in [-1, 1]);
* the pixel budget ``size = {"shortest_edge": 65536, "longest_edge": 16777216}`` px (256 x 256 .. 4096 x 4096),
  against Qwen2.5-VL's 56 x 56 .. 28 x 28 x 1280.

The processor class's own defaults are Qwen2-VL's (patch 14, CLIP mean/std) and never right for Qwen3-VL, so a
Qwen3-VL folder without the file, or a file without ``patch_size``, ``image_mean`` or ``image_std``, is refused
(``folder_config``). ``PUBLISHED`` holds the values every published Qwen3-VL folder carries (Qwen/Qwen3-VL-2B,
-4B, -8B, -32B-Instruct), for a model without a folder (the built-in presets).
"""
from __future__ import annotations

import os

from omnibal_ext.errors import UserError

from megatron.vlm.lineages.qwen.image_processing import (PREPROCESSOR_FILE, ImageProcessorConfig, folder_processor_dict,
                                                         preprocess_image, resized_grid)

__all__ = ["PUBLISHED", "REQUIRED_KEYS", "folder_config", "preprocess_image", "resized_grid"]

PUBLISHED = ImageProcessorConfig(min_pixels=65536, max_pixels=16777216, patch_size=16, temporal_patch_size=2,
                                 merge_size=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
"""The image processor settings of the published Qwen3-VL folders (their ``preprocessor_config.json``)."""

REQUIRED_KEYS = ("patch_size", "image_mean", "image_std")  # transformers' defaults for these are Qwen2-VL's


def folder_config(folder: str) -> tuple[ImageProcessorConfig, str]:
    """(the image processor settings of the Qwen3-VL Hugging Face folder ``folder``, the file they come from):
    ``processor_config.json``'s ``image_processor`` entry, else ``preprocessor_config.json``, as transformers reads
    them.

    Refuses (``UserError``) a folder with neither file, naming ``preprocessor_config.json``, and a file without one
    of ``REQUIRED_KEYS``, naming the file and the key: transformers would fill them with Qwen2-VL's values.
    """
    found = folder_processor_dict(folder)
    if found is None:
        raise UserError(f"{os.path.join(folder, PREPROCESSOR_FILE)}: no such file; a Qwen3-VL folder must hold its "
                        "image processor settings (patch 16, mean/std 0.5, the pixel budget): transformers' "
                        "defaults for them are Qwen2-VL's (patch 14, CLIP mean/std)")
    settings, where = found
    if isinstance(settings, dict):
        missing = [key for key in REQUIRED_KEYS if settings.get(key) is None]
        if missing:
            raise UserError(f"{where}: no {', '.join(missing)}; transformers would use Qwen2-VL's defaults, which do "
                            "not fit Qwen3-VL (published: patch_size 16, image_mean and image_std [0.5, 0.5, 0.5])")
    return ImageProcessorConfig.from_dict(settings, where=where), where
