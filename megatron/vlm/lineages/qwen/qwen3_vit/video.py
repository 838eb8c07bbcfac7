"""Qwen3-VL's video rule: transformers 5.23's ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor``, read for their
facts.

- **Frames.** ``n = int(total / src_fps * fps)`` clamped to ``[min_frames, max_frames]`` and the total, at
  ``linspace(0, total - 1, n)`` rounded (a folder with ``do_sample_frames`` false: every frame).
- **Size.** ``smart_resize`` budgets the whole video: ``t x h x w`` within ``[min_pixels, max_pixels]``
  (``size``, ``--video-total-pixels``); ``--video-max-pixels`` (a per-frame cap) is refused.
- **Time.** Before each temporal patch its processor writes ``<{t:.1f} seconds>``, ``t`` the mean of the patch's
  first and last frame index over the source fps (frames padded with the last to a multiple of the temporal
  patch).  ``second_per_grid_ts`` is no Qwen3-VL input.
- Pixels as Qwen2.5-VL's (``qwen2_5_vl.video``: per frame as the image processor, padded and patchified in time).

As the reader's rule (``Qwen3Frames``; ``data.video_rule`` builds it): a video of ``t`` temporal patches is ``t`` blocks of
``gh*gw`` patches, each after its timestamp text, ``<{t:.1f} seconds><|vision_start|><|video_pad|> x gh*gw/4
<|vision_end|>``; the ViT runs each block as a frame of ``grid_thw (1, gh, gw)`` (the same as the video's ``(t,
gh, gw)``: attention, positions and RoPE are per frame) and ``get_rope_index`` numbers each as an image.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron.vlm.data.template import IMAGE_PLACEHOLDER
from megatron.vlm.data.video_decode import VideoError
from megatron.vlm.data.video_sampling import (DEFAULT_VIDEO_FPS, VideoOverrides, VideoSettings, check_frames,
                                              temporal_padded, video_settings)
from megatron.vlm.lineages.qwen.image_processing import MAX_ASPECT_RATIO
from megatron.vlm.lineages.qwen.video import QwenFrames, VideoBlock

PROCESSOR = "qwen3_vl"
DEFAULTS = dict(sample_frames=True, fps=DEFAULT_VIDEO_FPS, min_frames=4, max_frames=768, min_pixels=128 * 32 * 32,
                max_pixels=32 * 32 * 768, patch_size=16, temporal_patch_size=2, merge_size=2, max_video_tokens=768)
REFUSED = {"max_pixels": "Qwen3-VL's video processor budgets pixels per video (t x h x w): use "
                         "--video-total-pixels"}


def settings(folder: str | None = None, overrides: VideoOverrides = VideoOverrides()) -> VideoSettings:
    """The processor's defaults, the folder's video processor file, the flags (``video_sampling.video_settings``)."""
    return video_settings(PROCESSOR, DEFAULTS, REFUSED, folder, overrides, total_pixels_budget=True)


def frame_indices(total: int, src_fps: float, s: VideoSettings) -> list[int]:
    """The frame indices: ``n = int(total / src_fps * fps)`` clamped to ``[min_frames, max_frames]`` and
    ``total``, at ``linspace(0, total - 1, n)`` rounded (half to even, as numpy rounds)."""
    check_frames(total, src_fps)
    if not s.sample_frames:
        return list(range(total))
    n = int(total / src_fps * s.fps)
    n = min(max(n, s.min_frames), s.max_frames, total)
    return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]


def _prefix(where: str | None) -> str:
    return f"{where}: " if where else ""


def smart_resize(num_frames: int, height: int, width: int, factor: int, temporal_factor: int,
                 min_pixels: int, max_pixels: int, where: str | None = None) -> tuple[int, int]:
    """The per-video resize: the ``(height, width)`` px all ``num_frames`` frames of ``height x width`` px become,
    multiples of ``factor``, with ``round(num_frames / temporal_factor) * temporal_factor x h x w`` kept within
    ``[min_pixels, max_pixels]`` (the budget scales the sides by ``sqrt(num_frames x area / max)``, floored, or
    ``sqrt(min / (num_frames x area))``, ceiled).  A side below ``factor`` is first scaled up to it.  Refuses
    fewer frames than ``temporal_factor`` and an aspect ratio over 200 (``VideoError``)."""
    if num_frames < temporal_factor:
        raise VideoError(f"{_prefix(where)}a video of {num_frames} frame(s): Qwen3-VL needs at least "
                         f"{temporal_factor} (one temporal patch)")
    if height <= 0 or width <= 0:
        raise VideoError(f"{_prefix(where)}video frames of {width}x{height} px (width x height) are empty")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise VideoError(f"{_prefix(where)}video frames of {width}x{height} px have an aspect ratio of "
                         f"{ratio:.1f}; the Qwen-VL processors accept at most {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_resize(num_frames: int, height: int, width: int, s: VideoSettings,
                 where: str | None = None) -> tuple[int, int]:
    """``(height, width)`` px of every sampled frame: ``smart_resize`` over the video's budget, with the folder's
    optional ``cap_pixels_per_frame`` (per frame: ``max_video_tokens`` tokens' pixels or an even share, floored at
    1.05 x ``min_pixels``)."""
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:
        frame_cap = s.max_video_tokens * s.factor * s.factor
        per_frame = max(min(frame_cap, s.max_pixels // num_frames), int(s.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return smart_resize(num_frames, height, width, s.factor, s.temporal_patch_size, s.min_pixels, max_pixels, where)


def video_grid_thw(num_frames: int, height: int, width: int, s: VideoSettings,
                   where: str | None = None) -> tuple[int, int, int]:
    """``video_grid_thw`` in patches: temporal patches x patch rows x patch columns."""
    h, w = video_resize(num_frames, height, width, s, where)
    return -(-num_frames // s.temporal_patch_size), h // s.patch_size, w // s.patch_size


def timestamps(indices: Sequence[int], src_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch as the processor writes them: the indices padded with the last up to a
    multiple of the temporal patch, then per patch the mean of its first and last frame's ``index / src_fps``."""
    seconds = [i / src_fps for i in temporal_padded(indices, temporal_patch_size)]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    """The text before one temporal patch's ``<|vision_start|>``: ``<{seconds:.1f} seconds>``."""
    return f"<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class Qwen3Frames(QwenFrames):
    """``QwenFrames`` with this module's sampling, per-video budget and timestamps."""

    def frame_indices(self, total, src_fps, seed, is_folder):
        return frame_indices(total, src_fps, self.settings)

    def resize(self, num_frames, height, width, where=None):
        return video_resize(num_frames, height, width, self.settings, where)

    def timestamps(self, indices, src_fps):
        return tuple(timestamps(indices, src_fps, self.settings.temporal_patch_size))

    def blocks(self, num_frames, width, height, where=None):
        t, gh, gw = self.grid(num_frames, width, height, where)
        return [gh * gw] * t

    def text(self, indices, src_fps):
        return "".join(timestamp_text(t) + IMAGE_PLACEHOLDER for t in self.timestamps(indices, src_fps))

    def block_info(self, indices, info, clip_s):
        t, gh, gw = self.grid(len(indices), info.width, info.height)
        return [VideoBlock((1, gh, gw), first=k == 0) for k in range(t)]


