"""One video sample for a family: probe, choose the frames its processor takes, decode only those.

``load_video(path, settings)`` is what a DataLoader worker calls per video; the pieces are
``video_decode`` (PyAV / frame folders, ``VideoError``) and ``video_sampling`` (``VideoSettings``, each family's
frame indices, resize sizes, Qwen3-VL's timestamps, Qwen2.5-VL's ``second_per_grid_ts``).  A clip
(``clip_s = (start, end)`` s, as InternVL meta entries and some ``messages`` records give) is sampled as a video
of its own frames; its indices stay the file's (so timestamps count from the file's start).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron.vlm.data.video_decode import (VideoError, VideoInfo, decode_frames, is_frame_folder,
                                            probe_video)
from megatron.vlm.data.video_sampling import VideoSettings, sample_frame_indices

__all__ = ["SampledVideo", "VideoError", "load_video", "clip_frames"]


@dataclass(frozen=True)
class SampledVideo:
    """A video's sampled frames: ``frames`` uint8 ``[len(indices), height, width, 3]`` RGB at the source size,
    ``indices`` the file's frame indices (before temporal padding), ``info`` its probe, ``decoded`` the frames
    decoded to get them."""

    info: VideoInfo
    indices: tuple[int, ...]
    frames: np.ndarray
    decoded: int


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


def load_video(path: str, settings: VideoSettings, where: str | None = None, seed: int = 0,
               clip_s: tuple[float, float] | None = None, seek: bool = True) -> SampledVideo:
    """Probe ``path`` (a file, or a frame folder at ``settings.folder_fps``), take ``settings.processor``'s frames
    (``seed``: InternVL's frame count) of it or of ``clip_s``, and decode them.  Bad input: ``VideoError``
    naming the file after ``where``."""
    info = probe_video(path, settings.folder_fps, where)
    first, count = clip_frames(info, clip_s, where)
    indices = [first + i for i in sample_frame_indices(count, info.fps, settings, seed, is_frame_folder(path))]
    decoded = decode_frames(path, info, indices, where, seek=seek)
    return SampledVideo(info=info, indices=tuple(indices), frames=decoded.frames, decoded=decoded.decoded)
