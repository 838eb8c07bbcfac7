"""Video rules: how the reader (``records.py``) turns a video into ViT items, text and pixels; and one video's
frames for a rule (``load_video``: probe, choose the frames the family's processor takes, decode only those).

A family's data side gives its rule (``DataSide.video_rule``; a family that does not declare
``Capabilities.video`` gives none and its reader refuses video records).  The reader asks the rule, per video,
which frames it takes (``frame_indices``, from the header alone), the ViT items of each image block the video
becomes in the text (``blocks``), the text that replaces the video's ``<video>`` tag (``text``, holding one
``<image>`` placeholder per block, which the chat template expands like an image's) and, when a sample is
loaded, the pixels (``pixels``: ``sum(blocks)`` rows).  The pieces are ``video_decode`` (PyAV / frame folders,
``VideoError``) and ``video_sampling`` (``VideoSettings``).  A clip (``clip_s = (start, end)`` s) is sampled as
a video of its own frames; its indices stay the file's (so times count from the file's start).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from megatron.vlm.data.video_decode import (VideoError, VideoInfo, decode_frames, is_frame_folder,
                                            probe_video)
from megatron.vlm.data.video_sampling import VideoSettings

__all__ = ["SampledVideo", "VideoError", "VideoRule", "load_video", "sampled_frames", "clip_frames", "video_seed"]


class VideoRule:
    """How a family's reader turns a video into ViT items, text and pixels (``ReaderConfig.videos``).

    ``settings``: its ``VideoSettings`` (``folder_fps`` for frame folders); ``frame_indices(total, src_fps, seed,
    is_folder)``: the source frames taken of a video of ``total`` frames at ``src_fps`` (``seed``: for a rule
    that draws, reproducible per sample); ``blocks(num_frames, width, height, where)``: the ViT items of each
    image block ``num_frames`` sampled frames of ``width x height`` px become (a ``VideoError`` for a video the
    family refuses); ``text(indices, src_fps)``: what replaces the ``<video>`` tag, one ``<image>`` per block;
    ``pixels(frames)``: the float32 ViT input of the sampled frames (uint8 ``[n, h, w, 3]``), ``sum(blocks)``
    rows.  ``unit``: what an item is, for stats.  ``block_info(indices, info, clip_s)``: what a family's batcher
    needs of each block beyond its size (None each by default: a block is an image); ``context_token``: the text
    token a block's context tokens become (None: the image context token).
    """

    settings: VideoSettings
    unit: str = "items"
    context_token: str | None = None

    def block_info(self, indices: Sequence[int], info: VideoInfo, clip_s: tuple[float, float] | None) -> list:
        return [None] * len(self.blocks(len(indices), info.width, info.height))

    def frame_indices(self, total: int, src_fps: float, seed: int, is_folder: bool) -> list[int]:
        raise NotImplementedError

    def blocks(self, num_frames: int, width: int, height: int, where: str | None = None) -> list[int]:
        raise NotImplementedError

    def text(self, indices: Sequence[int], src_fps: float) -> str:
        raise NotImplementedError

    def pixels(self, frames: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def temporal_patches(self, num_frames: int) -> int:
        """The ViT's attention segments in time of ``num_frames`` sampled frames (what stats and the time model
        count): temporal patches of ``settings.temporal_patch_size`` frames, the last padded, each attended as one
        image (the Qwen ViTs).  A rule whose frames are tiles overrides it (one segment per frame)."""
        return -(-num_frames // self.settings.temporal_patch_size)


@dataclass(frozen=True)
class SampledVideo:
    """A video's sampled frames: ``frames`` uint8 ``[len(indices), height, width, 3]`` RGB at the source size,
    ``indices`` the file's frame indices (before temporal padding), ``info`` its probe, ``decoded`` the frames
    decoded to get them."""

    info: VideoInfo
    indices: tuple[int, ...]
    frames: np.ndarray
    decoded: int


def video_seed(seed: int, source: int, line: int, video: int) -> int:
    """The seed of a record's ``video``-th video (``source``: the annotation's index, ``line``: 1-based): one value
    per (run seed, record, video), so the scan and every later load draw the same frames."""
    return int(np.random.SeedSequence([seed, source, line, video]).generate_state(1)[0])


def clip_frames(info: VideoInfo, clip_s: tuple[float, float] | None, where: str | None = None) -> tuple[int, int]:
    """``(first, count)``: the frames ``[first, first + count)`` of ``info`` in ``clip_s = (start, end)`` s
    (None: the whole video); refuses a clip holding no frame."""
    if clip_s is None:
        return 0, info.num_frames
    start, end = clip_s
    first = max(0, int(round(start * info.fps)))
    stop = min(info.num_frames, int(round(end * info.fps)))
    if stop <= first:
        prefix = f"{where}: " if where else ""
        raise VideoError(f"{prefix}video {info.path}: clip {start:g}-{end:g} s holds no frame of its "
                         f"{info.duration_s:.2f} s")
    return first, stop - first


def sampled_frames(path: str, rule: VideoRule, where: str | None = None, seed: int = 0,
                   clip_s: tuple[float, float] | None = None) -> tuple[VideoInfo, list[int]]:
    """``(probe, frame indices)``: probe ``path`` (a file, or a frame folder at ``rule.settings.folder_fps``; its
    header only) and take ``rule``'s frames of it or of ``clip_s`` (``seed``: for a rule that draws)."""
    info = probe_video(path, rule.settings.folder_fps, where)
    first, count = clip_frames(info, clip_s, where)
    return info, [first + i for i in rule.frame_indices(count, info.fps, seed, is_frame_folder(path))]


def load_video(path: str, rule: VideoRule, where: str | None = None, seed: int = 0,
               clip_s: tuple[float, float] | None = None, seek: bool = True) -> SampledVideo:
    """``sampled_frames``, then decode those frames.  Bad input: ``VideoError`` naming the file after ``where``."""
    info, indices = sampled_frames(path, rule, where, seed, clip_s)
    decoded = decode_frames(path, info, indices, where, seek=seek)
    return SampledVideo(info=info, indices=tuple(indices), frames=decoded.frames, decoded=decoded.decoded)
