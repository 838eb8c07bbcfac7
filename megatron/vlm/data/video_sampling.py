"""Which frames of a video a family's video processor takes, the size it resizes them to, and the time it writes.

Plain functions of (frame count, source fps, ``VideoSettings``), so that a stats scan can predict a video's ViT
work from its header alone.  The rules are transformers 5.23's (``Qwen2VLVideoProcessor``,
``Qwen3VLVideoProcessor``, ``Qwen3VLProcessor``, ``Qwen2_5_VLProcessor``) and InternVL's fine-tuning code's,
read for their facts:

- **Qwen2-VL / Qwen2.5-VL** do not sample by default (``do_sample_frames`` false: every frame); a folder that
  sets it, or any of ``--video-fps``/``--video-min-frames``/``--video-max-frames`` given (as transformers turns
  sampling on when a caller passes ``fps``), samples ``n = total / src_fps * fps`` frames, clamped to
  ``[min_frames, max_frames']`` and the total (``max_frames'``: ``min(max_frames, total)`` floored to a multiple
  of the temporal patch), then floored to a multiple of the temporal patch; the indices are torch's
  ``arange(0, total, total / n)`` in float32, truncated, which for some counts holds ``n + 1`` frames (kept, as
  transformers keeps them).  Each frame is ``smart_resize``d within ``[min_pixels, max_pixels]`` px
  (``size.shortest_edge``/``longest_edge``, ``--video-max-pixels``).
- **Qwen3-VL** samples ``n = int(total / src_fps * fps)`` clamped to ``[min_frames, max_frames]`` and the total,
  at ``linspace(0, total - 1, n)`` rounded; its ``smart_resize`` budgets the whole video: ``t x h x w`` within
  ``[min_pixels, max_pixels]`` (``size``, ``--video-total-pixels``).  Before each temporal patch its processor
  writes ``<{t:.1f} seconds>``, ``t`` the mean of the patch's first and last frame index over the source fps.
- Both pad a frame count that is not a multiple of the temporal patch by repeating the last frame
  (``temporal_padded``); Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch / sampled_fps`` with
  ``sampled_fps = n / total * src_fps``.
- **InternVL** (its fine-tuning code): a frame count drawn in ``[min_frames, max_frames]`` (8 and 32), the video
  cut into that many equal segments and each segment's middle frame taken; a file shorter than the count repeats
  its last frame, a frame folder gives all its frames.

Flags over the folder's ``video_preprocessor_config.json`` (``VideoOverrides``, ``video_settings``): a flag the
family does not implement is refused, never ignored.  Units: pixel counts are areas in px (height x width, and
x frames for a per-video budget), fps in frames per second, frame indices 0-based in the source's frames.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron.vlm.data.video_decode import DEFAULT_FOLDER_FPS, VideoError
from omnibal_ext.errors import UserError

PROCESSORS = ("qwen2_vl", "qwen3_vl", "internvl")
DEFAULT_VIDEO_FPS = 2.0  # --video-fps's default where the folder has no fps
MAX_ASPECT_RATIO = 200

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # may nest the video processor's dict under "video_processor"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # transformers' last resort (Qwen2.5-VL folders ship only this)


@dataclass(frozen=True)
class VideoOverrides:
    """The video flags as given on the command line; None: not given (the folder's value, else the default).

    ``fps``: frames sampled per second (``--video-fps``); ``min_frames``/``max_frames``: bounds on the sampled
    count; ``max_pixels``: per-frame area cap in px (Qwen2-VL's ``size.longest_edge``); ``total_pixels``:
    per-video budget in px x frames (Qwen3-VL's ``size.longest_edge``); ``folder_fps``: the rate given to a
    frame folder (``--video-folder-fps``).
    """

    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    folder_fps: float = DEFAULT_FOLDER_FPS

    @classmethod
    def from_args(cls, args) -> "VideoOverrides":
        """The flags of a parsed ``pretrain_vlm.py`` namespace (see ``--video-*`` in ``arguments.py``)."""
        return cls(fps=args.video_fps, min_frames=args.video_min_frames, max_frames=args.video_max_frames,
                   max_pixels=args.video_max_pixels, total_pixels=args.video_total_pixels,
                   folder_fps=args.video_folder_fps)


@dataclass(frozen=True)
class VideoSettings:
    """How one family's video processor samples and sizes a video.

    ``processor``: one of ``PROCESSORS``; ``sample_frames``: whether frames are sampled (else every frame is
    used; Qwen2-VL only); ``fps``: frames sampled per second; ``min_frames``/``max_frames``: bounds on the
    sampled count; ``min_pixels``/``max_pixels``: the resize's area bounds in px, per frame for Qwen2-VL,
    per video (frames x height x width) for Qwen3-VL, unused by InternVL (448-px tiles);
    ``cap_pixels_per_frame``/``max_video_tokens``: the optional extra cap both Qwen processors have (off unless
    the folder sets it); ``patch_size`` px, ``temporal_patch_size`` frames, ``merge_size`` patches;
    ``folder_fps``: the rate of a frame folder.
    """

    processor: str
    sample_frames: bool
    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int = 0
    max_pixels: int = 0
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 0
    folder_fps: float = DEFAULT_FOLDER_FPS

    def __post_init__(self) -> None:
        if self.processor not in PROCESSORS:
            raise UserError(f"video settings: processor must be one of {PROCESSORS}, got {self.processor!r}")
        for name in ("min_frames", "max_frames", "patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"video settings: {name} must be a positive integer, got {value!r}")
        if self.min_frames > self.max_frames:
            raise UserError(f"video settings: min_frames {self.min_frames} > max_frames {self.max_frames} "
                            "(--video-min-frames, --video-max-frames)")
        if not self.fps > 0 or not self.folder_fps > 0:
            raise UserError(f"video settings: fps {self.fps} and folder_fps {self.folder_fps} must be positive "
                            "(--video-fps, --video-folder-fps)")
        if self.processor != "internvl":
            if not 0 < self.min_pixels <= self.max_pixels:
                raise UserError(f"video settings: need 0 < min_pixels {self.min_pixels} <= max_pixels "
                                f"{self.max_pixels} (size.shortest_edge/longest_edge, --video-max-pixels, "
                                "--video-total-pixels)")

    @property
    def factor(self) -> int:
        """Side in px of one LLM token's square: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size


# The reference classes' own defaults (transformers 5.23), before a folder's file or a flag.
_CLASS_DEFAULTS = {
    "qwen2_vl": dict(sample_frames=False, fps=DEFAULT_VIDEO_FPS, min_frames=4, max_frames=768,
                     min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, patch_size=14, temporal_patch_size=2,
                     merge_size=2, max_video_tokens=128000),
    "qwen3_vl": dict(sample_frames=True, fps=DEFAULT_VIDEO_FPS, min_frames=4, max_frames=768,
                     min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16, temporal_patch_size=2,
                     merge_size=2, max_video_tokens=768),
    # InternVL's fine-tuning defaults: min_num_frame 8, max_num_frame 32
    "internvl": dict(sample_frames=True, fps=DEFAULT_VIDEO_FPS, min_frames=8, max_frames=32),
}


def video_processor_dict(folder: str) -> tuple[dict, str] | None:
    """(the video processor's settings, where they were read) of a Hugging Face model folder, found as
    transformers finds them: ``processor_config.json``'s ``video_processor`` entry, else
    ``video_preprocessor_config.json``, else ``preprocessor_config.json``; None when it has none of them."""
    nested = os.path.join(folder, PROCESSOR_FILE)
    if os.path.isfile(nested):
        d = _read_json(nested)
        if isinstance(d, dict) and isinstance(d.get("video_processor"), dict):
            return d["video_processor"], f"{nested}: video_processor"
    for name in (VIDEO_PROCESSOR_FILE, IMAGE_PROCESSOR_FILE):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return _read_json(path), path
    return None


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None


def _from_file(processor: str, d: dict, where: str) -> dict:
    """The settings a processor's constructor takes from its config dict (keys it does not read are left)."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(d).__name__}")
    out: dict = {}
    if processor == "internvl":
        return out  # InternVL's sampling is its training code's, not a Hugging Face video processor's
    if d.get("num_frames") is not None:
        raise UserError(f"{where}: num_frames (a fixed frame count) is not implemented; use --video-fps with "
                        "--video-min-frames/--video-max-frames")
    size = d.get("size")
    if size is not None:
        if not isinstance(size, dict) or not set(size) <= {"shortest_edge", "longest_edge"}:
            raise UserError(f"{where}: size must be {{'shortest_edge': ..., 'longest_edge': ...}}, got {size!r}")
        if "shortest_edge" in size:
            out["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            out["max_pixels"] = size["longest_edge"]
    if processor == "qwen2_vl":  # Qwen2-VL's constructor maps these onto size
        for key in ("min_pixels", "max_pixels"):
            if d.get(key) is not None:
                out[key] = d[key]
    keys = {"fps": "fps", "min_frames": "min_frames", "max_frames": "max_frames",
            "do_sample_frames": "sample_frames", "patch_size": "patch_size",
            "temporal_patch_size": "temporal_patch_size", "merge_size": "merge_size",
            "cap_pixels_per_frame": "cap_pixels_per_frame", "max_video_tokens": "max_video_tokens"}
    for key, name in keys.items():
        if d.get(key) is not None:
            out[name] = d[key]
    return out


_FLAG_OF = {"fps": "--video-fps", "min_frames": "--video-min-frames", "max_frames": "--video-max-frames",
            "max_pixels": "--video-max-pixels", "total_pixels": "--video-total-pixels"}
_REFUSED = {
    "qwen2_vl": {"total_pixels": "Qwen2-VL's video processor caps pixels per frame: use --video-max-pixels"},
    "qwen3_vl": {"max_pixels": "Qwen3-VL's video processor budgets pixels per video (t x h x w): use "
                               "--video-total-pixels"},
    "internvl": {"fps": "InternVL samples a frame count (--video-min-frames..--video-max-frames), not a rate",
                 "max_pixels": "InternVL makes each frame one 448-px tile",
                 "total_pixels": "InternVL makes each frame one 448-px tile"},
}


def video_settings(processor: str, folder: str | None = None,
                   overrides: VideoOverrides = VideoOverrides()) -> VideoSettings:
    """The ``VideoSettings`` of ``processor`` (``PROCESSORS``): the reference class's defaults, then the
    folder's video processor file (``video_processor_dict``; ``folder`` None: none), then the flags given.

    A flag the family does not implement is refused (``UserError`` naming it).  Giving ``--video-fps``,
    ``--video-min-frames`` or ``--video-max-frames`` turns Qwen2-VL's sampling on.  InternVL:
    ``--video-max-frames`` below its minimum (8) lowers the minimum with it.
    """
    if processor not in PROCESSORS:
        raise UserError(f"video settings: processor must be one of {PROCESSORS}, got {processor!r}")
    values = dict(_CLASS_DEFAULTS[processor])
    if folder is not None and processor != "internvl":
        found = video_processor_dict(folder)
        if found is not None:
            values.update(_from_file(processor, *found))
    for name, reason in _REFUSED[processor].items():
        if getattr(overrides, name) is not None:
            raise UserError(f"{_FLAG_OF[name]} is not implemented for {processor}: {reason}")
    given = {name: getattr(overrides, name) for name in ("fps", "min_frames", "max_frames")
             if getattr(overrides, name) is not None}
    values.update(given)
    if given:
        values["sample_frames"] = True
    if overrides.max_pixels is not None:
        values["max_pixels"] = overrides.max_pixels
    if overrides.total_pixels is not None:
        values["max_pixels"] = overrides.total_pixels
    if processor == "internvl" and overrides.max_frames is not None and overrides.min_frames is None:
        values["min_frames"] = min(values["min_frames"], overrides.max_frames)
    values["folder_fps"] = overrides.folder_fps
    values["fps"] = float(values["fps"])
    return VideoSettings(processor=processor, **values)


# ------------------------------------------------------------------------------------------------ frame sampling

def _check_frames(total: int, src_fps: float) -> None:
    if total < 1:
        raise ValueError(f"frame sampling: a video needs at least one frame, got {total}")
    if not src_fps > 0:
        raise ValueError(f"frame sampling: source fps must be positive, got {src_fps}")


def qwen2_vl_frame_indices(total: int, src_fps: float, s: VideoSettings) -> list[int]:
    """Qwen2-VL's frame indices of a video of ``total`` frames at ``src_fps``: every frame when not sampling;
    else the fps rule (module docstring).  A video shorter than one temporal patch (where transformers divides
    by zero) keeps every frame."""
    _check_frames(total, src_fps)
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


def qwen3_vl_frame_indices(total: int, src_fps: float, s: VideoSettings) -> list[int]:
    """Qwen3-VL's frame indices: ``n = int(total / src_fps * fps)`` clamped to ``[min_frames, max_frames]``
    and ``total``, at ``linspace(0, total - 1, n)`` rounded (half to even, as numpy rounds)."""
    _check_frames(total, src_fps)
    if not s.sample_frames:  # a folder with do_sample_frames false: every frame
        return list(range(total))
    n = int(total / src_fps * s.fps)
    n = min(max(n, s.min_frames), s.max_frames, total)
    return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]


def internvl_frame_count(s: VideoSettings, seed: int) -> int:
    """InternVL's frame count: drawn uniformly in ``[min_frames, max_frames]`` (its fine-tuning code draws one
    per sample), reproducibly from ``seed`` (e.g. the run's seed and the sample's index)."""
    return int(np.random.default_rng(seed).integers(s.min_frames, s.max_frames + 1))


def internvl_frame_indices(total: int, count: int, pad: bool = True) -> list[int]:
    """InternVL's frames: ``total`` frames cut into ``min(count, total)`` segments at
    ``linspace(0, total, segments + 1)`` (truncated), each segment's middle frame; ``pad``: a video with fewer
    frames than ``count`` repeats its last (InternVL's files; its frame folders do not pad)."""
    if total < 1 or count < 1:
        raise ValueError(f"InternVL frame sampling: need total >= 1 and count >= 1, got {total}, {count}")
    segments = min(count, total)
    bounds = np.linspace(0, total, segments + 1).astype(int)
    indices = [(int(a) + int(b) - 1) // 2 for a, b in zip(bounds[:-1], bounds[1:])]
    if pad and len(indices) < count:
        indices += [indices[-1]] * (count - len(indices))
    return indices


def sample_frame_indices(total: int, src_fps: float, s: VideoSettings, seed: int = 0,
                         is_folder: bool = False) -> list[int]:
    """The frame indices ``s.processor`` takes of a video of ``total`` frames at ``src_fps`` (``seed``: InternVL's
    frame count; ``is_folder``: InternVL does not pad a frame folder)."""
    if s.processor == "qwen2_vl":
        return qwen2_vl_frame_indices(total, src_fps, s)
    if s.processor == "qwen3_vl":
        return qwen3_vl_frame_indices(total, src_fps, s)
    return internvl_frame_indices(total, internvl_frame_count(s, seed), pad=not is_folder)


def temporal_padded(indices: Sequence[int], temporal_patch_size: int) -> list[int]:
    """``indices`` with the last repeated up to a multiple of ``temporal_patch_size``: the frames the ViT's
    temporal patches see (both Qwen processors pad so in ``patchify``)."""
    out = list(indices)
    out += [out[-1]] * (-len(out) % temporal_patch_size)
    return out


# ---------------------------------------------------------------------------------------------------- resizing

def _prefix(where: str | None) -> str:
    return f"{where}: " if where else ""


def qwen3_vl_smart_resize(num_frames: int, height: int, width: int, factor: int, temporal_factor: int,
                          min_pixels: int, max_pixels: int, where: str | None = None) -> tuple[int, int]:
    """Qwen3-VL's per-video resize: the ``(height, width)`` px all ``num_frames`` frames of ``height x width`` px
    become, multiples of ``factor``, with ``round(num_frames / temporal_factor) * temporal_factor x h x w``
    kept within ``[min_pixels, max_pixels]`` (the budget scales the sides by ``sqrt(num_frames x area / max)``,
    floored, or ``sqrt(min / (num_frames x area))``, ceiled).  A side below ``factor`` is first scaled up to it.
    Refuses fewer frames than ``temporal_factor`` and an aspect ratio over 200 (``VideoError``)."""
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
    """``(height, width)`` in px that every sampled frame (``num_frames`` of them, before temporal padding) of
    ``height x width`` px is resized to by ``s.processor``'s rule (InternVL: one 448 tile, not sized here)."""
    if s.processor == "qwen2_vl":
        from megatron.vlm.families.qwen2_5_vl.image_processing import ImageSizeError, smart_resize

        max_pixels = s.max_pixels
        if s.cap_pixels_per_frame:  # an even share of max_video_tokens' pixels, floored at 1.05 x min
            total_pixels = int(s.max_video_tokens * s.factor * s.factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * s.temporal_patch_size // num_frames),
                             int(s.min_pixels * 1.05))
        try:
            return smart_resize(height, width, s.factor, s.min_pixels, max_pixels, where)
        except ImageSizeError as e:
            raise VideoError(str(e).replace("image", "video frame", 1)) from None
    if s.processor == "qwen3_vl":
        max_pixels = s.max_pixels
        if s.cap_pixels_per_frame:  # per frame: max_video_tokens patches or an even share, floored at 1.05 x min
            frame_cap = s.max_video_tokens * s.factor * s.factor
            per_frame = max(min(frame_cap, s.max_pixels // num_frames), int(s.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return qwen3_vl_smart_resize(num_frames, height, width, s.factor, s.temporal_patch_size, s.min_pixels,
                                     max_pixels, where)
    raise ValueError("video_resize: InternVL frames are 448-px tiles, not resized by a pixel rule")


def video_grid_thw(num_frames: int, height: int, width: int, s: VideoSettings,
                   where: str | None = None) -> tuple[int, int, int]:
    """``video_grid_thw`` in patches of ``num_frames`` sampled frames of ``height x width`` px: temporal patches
    (frames padded to a multiple of the temporal patch) x patch rows x patch columns."""
    h, w = video_resize(num_frames, height, width, s, where)
    return -(-num_frames // s.temporal_patch_size), h // s.patch_size, w // s.patch_size


# ------------------------------------------------------------------------------------------------------ timing

def qwen3_vl_timestamps(indices: Sequence[int], src_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch as Qwen3-VL's processor writes them: the indices padded with the last up
    to a multiple of the temporal patch, then per patch the mean of its first and last frame's ``index / src_fps``."""
    seconds = [i / src_fps for i in temporal_padded(indices, temporal_patch_size)]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def qwen3_vl_timestamp_text(seconds: float) -> str:
    """The text before one temporal patch's ``<|vision_start|>``: ``<{seconds:.1f} seconds>``."""
    return f"<{seconds:.1f} seconds>"


def second_per_grid_ts(num_sampled: int, total: int, src_fps: float, temporal_patch_size: int = 2) -> float:
    """Qwen2.5-VL's ``second_per_grid_ts``: seconds per temporal patch, ``temporal_patch_size / sampled_fps``
    with ``sampled_fps = num_sampled / total * src_fps`` (frames taken per second of source)."""
    return temporal_patch_size / (num_sampled / total * src_fps)


__all__ = [
    "PROCESSORS", "VideoOverrides", "VideoSettings", "video_settings", "video_processor_dict",
    "qwen2_vl_frame_indices", "qwen3_vl_frame_indices", "internvl_frame_count", "internvl_frame_indices",
    "sample_frame_indices", "temporal_padded", "qwen3_vl_smart_resize", "video_resize", "video_grid_thw",
    "qwen3_vl_timestamps", "qwen3_vl_timestamp_text", "second_per_grid_ts",
]
