"""Qwen2.5-VL's video rule: transformers 5.23's ``Qwen2VLVideoProcessor`` (which Qwen2.5-VL folders use) and
``Qwen2_5_VLProcessor``, read for their facts.

- **Frames.** Not sampled by default (``do_sample_frames`` false: every frame); a folder that sets it, or any of
  ``--video-fps``/``--video-min-frames``/``--video-max-frames`` given (transformers turns sampling on when a
  caller passes ``fps``), samples ``n = total / src_fps * fps`` frames, clamped to ``[min_frames, max_frames']``
  and the total (``max_frames'``: ``min(max_frames, total)`` floored to a multiple of the temporal patch), then
  floored to a multiple of the temporal patch; the indices are torch's ``arange(0, total, total / n)`` in
  float32, truncated, which for some counts holds ``n + 1`` frames (kept, as transformers keeps them).
- **Size.** Each frame is ``smart_resize``d within ``[min_pixels, max_pixels]`` px (``size.shortest_edge``/
  ``longest_edge``, top-level ``min_pixels``/``max_pixels``, ``--video-max-pixels``; per frame).
- **Time.** ``second_per_grid_ts = temporal_patch / sampled_fps``, ``sampled_fps = n / total * src_fps``.
- The frames are padded to a multiple of the temporal patch by repeating the last (``temporal_padded``) and
  patchified in time: ``grid_thw = (t, gh, gw)``, rows ordered by temporal patch, then as an image's.

``video_sample`` gives what the model side needs of one video (pixel rows, ``video_grid_thw``,
``second_per_grid_ts``).  As the reader's rule (``QwenFrames``; ``data.video_rule`` builds it): a video is one block of
``t*gh*gw`` patches in the text, ``<|vision_start|>`` + ``<|video_pad|>`` x ``t*gh*gw/4`` + ``<|vision_end|>``
(the ``<video>`` tag becomes one ``<image>`` placeholder whose context tokens the reader makes ``<|video_pad|>``),
with a ``VideoBlock`` (grid, ``second_per_grid_ts``) for the batcher's 3-D RoPE ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from omnibal_ext.errors import UserError

from .image_processing import ImageProcessorConfig, ImageSizeError, smart_resize
from megatron.vlm.data.template import IMAGE_PLACEHOLDER
from megatron.vlm.data.video import VideoRule, clip_frames, load_video
from megatron.vlm.data.video_decode import VideoError
from megatron.vlm.data.video_sampling import (DEFAULT_VIDEO_FPS, VideoOverrides, VideoSettings, check_frames,
                                              temporal_padded, video_settings)

PROCESSOR = "qwen2_vl"
DEFAULTS = dict(sample_frames=False, fps=DEFAULT_VIDEO_FPS, min_frames=4, max_frames=768, min_pixels=128 * 28 * 28,
                max_pixels=28 * 28 * 768, patch_size=14, temporal_patch_size=2, merge_size=2, max_video_tokens=128000)
REFUSED = {"total_pixels": "Qwen2-VL's video processor caps pixels per frame: use --video-max-pixels"}


def settings(folder: str | None = None, overrides: VideoOverrides = VideoOverrides()) -> VideoSettings:
    """The processor's defaults, the folder's video processor file, the flags (``video_sampling.video_settings``)."""
    return video_settings(PROCESSOR, DEFAULTS, REFUSED, folder, overrides, top_level_pixels=True)


def frame_indices(total: int, src_fps: float, s: VideoSettings) -> list[int]:
    """The frame indices of a video of ``total`` frames at ``src_fps``: every frame when not sampling; else the
    fps rule (module docstring).  A video shorter than one temporal patch (where transformers divides by zero)
    keeps every frame."""
    check_frames(total, src_fps)
    if not s.sample_frames:
        return list(range(total))
    tp = s.temporal_patch_size
    max_frames = math.floor(min(s.max_frames, total) / tp) * tp
    n = total / src_fps * s.fps
    n = min(max(n, s.min_frames), max_frames, total)
    n = math.floor(n / tp) * tp
    if n <= 0:
        return list(range(total))
    # torch.arange(0, total, step) in float32: its length is ceil(total / step) in double, each value the double
    # i * step rounded to float32; .int() truncates.
    step = total / n
    count = math.ceil(total / step)
    return [int(v) for v in (np.arange(count, dtype=np.float64) * step).astype(np.float32)]


def video_resize(num_frames: int, height: int, width: int, s: VideoSettings,
                 where: str | None = None) -> tuple[int, int]:
    """``(height, width)`` in px every sampled frame (``num_frames``, before temporal padding) of ``height x
    width`` px is resized to: ``smart_resize`` per frame, with the folder's optional ``cap_pixels_per_frame``
    (an even share of ``max_video_tokens``' pixels, floored at 1.05 x ``min_pixels``)."""
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:
        total_pixels = int(s.max_video_tokens * s.factor * s.factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * s.temporal_patch_size // num_frames),
                         int(s.min_pixels * 1.05))
    try:
        return smart_resize(height, width, s.factor, s.min_pixels, max_pixels, where)
    except ImageSizeError as e:
        raise VideoError(str(e).replace("image", "video frame", 1)) from None


def video_grid_thw(num_frames: int, height: int, width: int, s: VideoSettings,
                   where: str | None = None) -> tuple[int, int, int]:
    """``video_grid_thw`` in patches: temporal patches (frames padded to a multiple of the temporal patch) x patch
    rows x patch columns."""
    h, w = video_resize(num_frames, height, width, s, where)
    return -(-num_frames // s.temporal_patch_size), h // s.patch_size, w // s.patch_size


def second_per_grid_ts(num_sampled: int, total: int, src_fps: float, temporal_patch_size: int = 2) -> float:
    """Seconds per temporal patch: ``temporal_patch_size / sampled_fps`` with ``sampled_fps = num_sampled / total
    * src_fps`` (frames taken per second of source)."""
    return temporal_patch_size / (num_sampled / total * src_fps)


def patchify_frames(frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """Rows ``[t*gh*gw, C*T*p*p]`` of normalised frames ``[t*T, C, H, W]`` (``T = temporal_patch_size``): row
    order temporal patch, merge group (row, column), patch within the group row-major; values within a row
    ``(channel, frame, y, x)``, the layout of the ViT's Conv3d patch embedding."""
    n, c, height, width = frames.shape
    p, m, tp = patch_size, merge_size, temporal_patch_size
    gh, gw = height // p, width // p
    if n % tp or gh * p != height or gw * p != width or gh % m or gw % m:
        raise ValueError(f"patchify_frames: {n} frames of {height}x{width} px are not whole temporal patches of "
                         f"{m}x{m} groups of {p} px patches")
    # axes: t, frame, c, group row, row in group, y, group col, col in group, x
    blocks = frames.reshape(n // tp, tp, c, gh // m, m, p, gw // m, m, p)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(blocks).reshape(n // tp * gh * gw, c * tp * p * p)


def frame_rows(frames: np.ndarray, size: tuple[int, int], processor: ImageProcessorConfig) -> np.ndarray:
    """Patch rows of sampled frames (uint8 ``[n, h, w, 3]``) resized to ``size = (height, width)`` px as the
    image processor resizes an image (PIL, its filter), rescaled and normalised as it does, padded in time with
    the last frame and patchified in time."""
    tp = processor.temporal_patch_size
    height, width = size
    mean = np.asarray(processor.image_mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(processor.image_std, dtype=np.float32).reshape(3, 1, 1)
    out = []
    for k in temporal_padded(range(len(frames)), tp):
        resized = Image.fromarray(frames[k]).resize((width, height), resample=processor.resample)
        scaled = (np.asarray(resized).transpose(2, 0, 1).astype(np.float64) * processor.rescale_factor)
        out.append((scaled.astype(np.float32) - mean) / std)
    return patchify_frames(np.stack(out), processor.patch_size, processor.merge_size, tp)


@dataclass(frozen=True)
class QwenVideo:
    """One video as the model side takes it: ``pixel_values`` float32 ``[t*gh*gw, 3*T*p*p]`` (rows as
    ``patchify_frames``), ``grid_thw`` ``(t, gh, gw)`` patches, ``indices`` the source frames sampled (before
    temporal padding), ``src_fps``, ``second_per_grid_ts`` s per temporal patch, ``timestamps`` s of each temporal
    patch where the family writes them (else empty), ``tokens`` the LLM tokens (``t*gh*gw / merge^2``)."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    indices: tuple[int, ...]
    src_fps: float
    second_per_grid_ts: float
    timestamps: tuple[float, ...]
    tokens: int


@dataclass(frozen=True)
class VideoBlock:
    """What the batcher needs of one image block a video becomes (``VideoRule.block_info``): ``grid_thw`` (t, gh,
    gw) patches, ``second_per_grid_ts`` s per temporal patch (None: a family without it, Qwen3-VL), ``first``
    whether it is the video's first block."""

    grid_thw: tuple[int, int, int]
    second_per_grid_ts: float | None = None
    first: bool = True  # the video's first block (its drop path key, shared by its other blocks)


@dataclass(frozen=True)
class QwenFrames(VideoRule):
    """Frame sampling and sizing by ``settings`` (a ``VideoSettings`` of this module's rule), pixel values by the
    image processor's ``processor``; ``video_sample`` makes one ``QwenVideo``; as the reader's rule, a video is one
    block of ``t*gh*gw`` patches (module docstring)."""

    settings: VideoSettings
    processor: ImageProcessorConfig = ImageProcessorConfig()
    unit = "patches"
    context_token = "<|video_pad|>"

    def grid(self, num_frames: int, width: int, height: int, where: str | None = None) -> tuple[int, int, int]:
        """``video_grid_thw`` (t, gh, gw) patches of ``num_frames`` sampled frames of ``width x height`` px."""
        s = self.settings
        h, w = self.resize(num_frames, height, width, where)
        return -(-num_frames // s.temporal_patch_size), h // s.patch_size, w // s.patch_size

    def blocks(self, num_frames, width, height, where=None):
        t, gh, gw = self.grid(num_frames, width, height, where)
        return [t * gh * gw]

    def text(self, indices, src_fps):
        return IMAGE_PLACEHOLDER

    def pixels(self, frames):
        n, height, width = frames.shape[:3]
        return torch.from_numpy(frame_rows(frames, self.resize(n, height, width), self.processor))

    def block_info(self, indices, info, clip_s):
        _, total = clip_frames(info, clip_s)
        seconds = second_per_grid_ts(len(indices), total, info.fps, self.settings.temporal_patch_size)
        return [VideoBlock(self.grid(len(indices), info.width, info.height), seconds)]

    def frame_indices(self, total, src_fps, seed, is_folder):
        return frame_indices(total, src_fps, self.settings)

    def resize(self, num_frames: int, height: int, width: int, where: str | None = None) -> tuple[int, int]:
        return video_resize(num_frames, height, width, self.settings, where)

    def timestamps(self, indices, src_fps) -> tuple[float, ...]:
        return ()

    def video_sample(self, path: str, where: str | None = None, clip_s: tuple[float, float] | None = None,
                     seed: int = 0) -> QwenVideo:
        """Decode the sampled frames of ``path`` (a file or a frame folder) and make their ``QwenVideo``."""
        video = load_video(path, self, where, seed, clip_s)
        n, h, w = len(video.indices), video.info.height, video.info.width
        size = self.resize(n, h, w, where)
        s = self.settings
        rows = frame_rows(video.frames, size, self.processor)
        grid = (-(-n // s.temporal_patch_size), size[0] // s.patch_size, size[1] // s.patch_size)
        _, total = clip_frames(video.info, clip_s, where)  # the frames sampled from: the file's or the clip's
        seconds = second_per_grid_ts(n, total, video.info.fps, s.temporal_patch_size)
        return QwenVideo(rows, grid, video.indices, video.info.fps, seconds,
                         tuple(self.timestamps(video.indices, video.info.fps)),
                         grid[0] * grid[1] * grid[2] // s.merge_size ** 2)


def check_geometry(s: VideoSettings, spec, hf_folder: str | None) -> VideoSettings:
    """``s`` when its patch, temporal patch and merge sizes are the ViT's, else a ``UserError`` naming the folder's
    video processor file (its rows would not be the ViT's patches)."""

    v = spec.vision
    have = (s.patch_size, s.temporal_patch_size, s.merge_size)
    want = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
    if have != want:
        raise UserError(f"{hf_folder or 'the video processor defaults'}: video processor patch_size / "
                        f"temporal_patch_size / merge_size {have} differ from the model's vision_config {want}")
    return s
