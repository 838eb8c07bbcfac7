"""InternVL's video rule: frames as tiles, as InternVL's own fine-tuning code (``internvl_chat_finetune.py``'s
``video_get_item`` and its frame readers) does, read for its facts.

- **Frames.** A frame count drawn uniformly in ``[min_frames, max_frames]`` (8 and 32, its
  ``min_num_frame``/``max_num_frame``; ``--video-min-frames``/``--video-max-frames``, the latter alone also lowering
  the minimum), the video cut into that many equal segments at ``linspace(0, total, segments + 1)`` (truncated)
  and each segment's middle frame taken; a file shorter than the count repeats its last frame, a frame folder
  gives all its frames.  The count is drawn once per record and video (``video.video_seed``), so the validation
  scan and every load agree.  ``--video-fps``, ``--video-max-pixels`` and ``--video-total-pixels`` are refused
  (it samples a count, and every frame is one tile).
- **Pixels.** Each frame is one square tile of the ViT's image size (448 px for the published models): the frame
  resized to ``size x size`` bicubic, as the tiling resizes an image of one tile, then normalised as tiles are.
- **Text.** The video's ``<video>`` tag becomes one line per frame, ``Frame-{i}: <image>`` with ``i`` from 1,
  joined by newlines (InternVL's code replaces ``<video>\\n`` by those lines and the newline; transformers'
  processor writes ``Frame{i}: `` without the hyphen, which InternVL's fine-tuned models did not see); each
  ``<image>`` is one tile's image block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from megatron.vlm.data.template import IMAGE_PLACEHOLDER
from megatron.vlm.data.tiling import tiles_to_tensor
from megatron.vlm.data.images import MediaOverrides
from megatron.vlm.data.video import VideoRule
from megatron.vlm.data.video_sampling import DEFAULT_VIDEO_FPS, VideoOverrides, VideoSettings, video_settings

PROCESSOR = "internvl"
DEFAULTS = dict(sample_frames=True, fps=DEFAULT_VIDEO_FPS, min_frames=8, max_frames=32)
REFUSED = {"fps": "InternVL samples a frame count (--video-min-frames..--video-max-frames), not a rate",
           "max_pixels": "InternVL makes each frame one tile of the ViT's image size",
           "total_pixels": "InternVL makes each frame one tile of the ViT's image size"}


def settings(overrides: VideoOverrides = VideoOverrides()) -> VideoSettings:
    """Its fine-tuning defaults (8 to 32 frames) with the frame flags; no folder file (its sampling is its
    training code's, not a Hugging Face video processor's)."""
    return video_settings(PROCESSOR, DEFAULTS, REFUSED, None, overrides)


def frame_count(s: VideoSettings, seed: int) -> int:
    """The frame count: drawn uniformly in ``[min_frames, max_frames]``, reproducibly from ``seed``."""
    return int(np.random.default_rng(seed).integers(s.min_frames, s.max_frames + 1))


def frame_indices(total: int, count: int, pad: bool = True) -> list[int]:
    """``total`` frames cut into ``min(count, total)`` segments at ``linspace(0, total, segments + 1)``
    (truncated), each segment's middle frame; ``pad``: a video with fewer frames than ``count`` repeats its last
    (files; frame folders do not pad)."""
    if total < 1 or count < 1:
        raise ValueError(f"InternVL frame sampling: need total >= 1 and count >= 1, got {total}, {count}")
    segments = min(count, total)
    bounds = np.linspace(0, total, segments + 1).astype(int)
    indices = [(int(a) + int(b) - 1) // 2 for a, b in zip(bounds[:-1], bounds[1:])]
    if pad and len(indices) < count:
        indices += [indices[-1]] * (count - len(indices))
    return indices


def frames_text(num_frames: int) -> str:
    """What replaces a video's ``<video>`` tag: ``Frame-{i}: <image>`` for i = 1..num_frames, one line each."""
    return "\n".join(f"Frame-{i}: {IMAGE_PLACEHOLDER}" for i in range(1, num_frames + 1))


@dataclass(frozen=True)
class FramesAsTiles(VideoRule):
    """Each sampled frame one ``image_size``-px tile (``tokens_per_tile`` image tokens), sampled by ``settings``."""

    settings: VideoSettings
    image_size: int
    unit = "tiles"

    def frame_indices(self, total, src_fps, seed, is_folder):
        return frame_indices(total, frame_count(self.settings, seed), pad=not is_folder)

    def blocks(self, num_frames, width, height, where=None):
        return [1] * num_frames

    def temporal_patches(self, num_frames: int) -> int:
        return num_frames  # every frame its own tile

    def text(self, indices: Sequence[int], src_fps: float) -> str:
        return frames_text(len(indices))

    def pixels(self, frames: np.ndarray) -> torch.Tensor:
        size = self.image_size
        return tiles_to_tensor([Image.fromarray(f).resize((size, size), Image.Resampling.BICUBIC) for f in frames])


def video_rule(media: MediaOverrides, spec, hf_folder) -> FramesAsTiles:
    """The reader's video rule (``DataSide.video_rule``): frames as tiles of the ViT's image size, the frame
    flags over the fine-tuning defaults."""
    return FramesAsTiles(settings(media.video), spec.vision.image_size)
