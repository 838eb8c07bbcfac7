"""A family's video processor settings: the dataclasses, the folder's file and the flags over it.

Shared by every family's video rule (``megatron/vlm/families/<name>/video.py``: which frames it takes, the size
it resizes them to, the text it writes); a family gives its processor's own defaults, the keys of the folder's
file its constructor reads and the flags it does not implement, and ``video_settings`` combines them:
the family's defaults, then the folder's video processor file (``video_processor_dict``, found as transformers
finds it), then the flags given (``VideoOverrides``).  A flag the family does not implement is refused, never
ignored.  Units: pixel counts are areas in px (height x width, and x frames for a per-video budget), fps in
frames per second, frame indices 0-based in the source's frames.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Mapping, Sequence

from megatron.vlm.data.video_decode import DEFAULT_FOLDER_FPS
from omnibal_ext.errors import UserError

DEFAULT_VIDEO_FPS = 2.0  # --video-fps's default where the family's processor and the folder give none

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # may nest the video processor's dict under "video_processor"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # transformers' last resort (some folders ship only this)

FLAG_OF = {"fps": "--video-fps", "min_frames": "--video-min-frames", "max_frames": "--video-max-frames",
           "max_pixels": "--video-max-pixels", "total_pixels": "--video-total-pixels"}


@dataclass(frozen=True)
class VideoOverrides:
    """The video flags as given on the command line; None: not given (the folder's value, else the default).

    ``fps``: frames sampled per second (``--video-fps``); ``min_frames``/``max_frames``: bounds on the sampled
    count; ``max_pixels``: per-frame area cap in px (``--video-max-pixels``); ``total_pixels``: per-video budget
    in px x frames (``--video-total-pixels``); ``folder_fps``: the rate given to a frame folder
    (``--video-folder-fps``).
    """

    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    folder_fps: float = DEFAULT_FOLDER_FPS

    @classmethod
    def from_args(cls, flags) -> "VideoOverrides":
        """The flags of a parsed ``pretrain_vlm.py`` namespace (see ``--video-*`` in ``megatron/training/flags.py``)."""
        return cls(fps=flags.video_fps, min_frames=flags.video_min_frames, max_frames=flags.video_max_frames,
                   max_pixels=flags.video_max_pixels, total_pixels=flags.video_total_pixels,
                   folder_fps=flags.video_folder_fps)

    def given(self) -> tuple[str, ...]:
        """The flags given (``--video-folder-fps`` when not its default)."""
        out = tuple(flag for name, flag in FLAG_OF.items() if getattr(self, name) is not None)
        return out + (("--video-folder-fps",) if self.folder_fps != DEFAULT_FOLDER_FPS else ())


@dataclass(frozen=True)
class VideoSettings:
    """How one family's video processor samples and sizes a video.

    ``processor``: the processor's name (in messages); ``sample_frames``: whether frames are sampled (else every
    frame is used); ``fps``: frames sampled per second; ``min_frames``/``max_frames``: bounds on the sampled
    count; ``min_pixels``/``max_pixels``: the resize's area bounds in px (per frame or per video, as the family's
    rule reads them; 0 and 0: unused, fixed-size tiles); ``cap_pixels_per_frame``/``max_video_tokens``: an
    optional extra cap of some processors (off unless the folder sets it); ``patch_size`` px,
    ``temporal_patch_size`` frames, ``merge_size`` patches; ``folder_fps``: the rate of a frame folder.
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
        if (self.min_pixels or self.max_pixels) and not 0 < self.min_pixels <= self.max_pixels:
            raise UserError(f"video settings: need 0 < min_pixels {self.min_pixels} <= max_pixels "
                            f"{self.max_pixels} (size.shortest_edge/longest_edge, --video-max-pixels, "
                            "--video-total-pixels)")

    @property
    def factor(self) -> int:
        """Side in px of one LLM token's square: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size


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


_FILE_KEYS = {"fps": "fps", "min_frames": "min_frames", "max_frames": "max_frames", "do_sample_frames": "sample_frames",
              "patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size", "merge_size": "merge_size",
              "cap_pixels_per_frame": "cap_pixels_per_frame", "max_video_tokens": "max_video_tokens"}


def file_values(d, where: str, top_level_pixels: bool = False) -> dict:
    """The settings a video processor's constructor takes from its config dict ``d`` (keys it does not read are
    left): ``size.shortest_edge``/``longest_edge`` as ``min_pixels``/``max_pixels``, the frame and patch keys;
    ``top_level_pixels``: the constructor also maps top-level ``min_pixels``/``max_pixels`` onto ``size``.
    A fixed frame count (``num_frames``) is refused."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("num_frames") is not None:
        raise UserError(f"{where}: num_frames (a fixed frame count) is not implemented; use --video-fps with "
                        "--video-min-frames/--video-max-frames")
    out: dict = {}
    size = d.get("size")
    if size is not None:
        if not isinstance(size, dict) or not set(size) <= {"shortest_edge", "longest_edge"}:
            raise UserError(f"{where}: size must be {{'shortest_edge': ..., 'longest_edge': ...}}, got {size!r}")
        if "shortest_edge" in size:
            out["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            out["max_pixels"] = size["longest_edge"]
    if top_level_pixels:
        for key in ("min_pixels", "max_pixels"):
            if d.get(key) is not None:
                out[key] = d[key]
    for key, name in _FILE_KEYS.items():
        if d.get(key) is not None:
            out[name] = d[key]
    return out


def video_settings(processor: str, defaults: Mapping, refused: Mapping[str, str], folder: str | None = None,
                   overrides: VideoOverrides = VideoOverrides(), *, read_folder: bool = True,
                   top_level_pixels: bool = False, total_pixels_budget: bool = False) -> VideoSettings:
    """The ``VideoSettings`` of a family's processor named ``processor``: its ``defaults`` (``VideoSettings``
    fields), then the folder's video processor file (``read_folder``; ``folder`` None: none; ``file_values``),
    then the flags given.

    ``refused``: ``VideoOverrides`` field -> why the family does not implement that flag (a ``UserError`` naming
    the flag when it is given).  Giving ``--video-fps``, ``--video-min-frames`` or ``--video-max-frames`` turns
    sampling on (as transformers does when a caller passes ``fps``); ``--video-max-frames`` alone below the
    minimum lowers the minimum with it.  ``--video-max-pixels`` sets ``max_pixels``, or ``--video-total-pixels``
    does where ``total_pixels_budget`` (a per-video budget).
    """
    values = dict(defaults)
    unknown = set(values) - {f.name for f in fields(VideoSettings)}
    if unknown:
        raise ValueError(f"video settings of {processor}: unknown fields {sorted(unknown)}")
    if folder is not None and read_folder:
        found = video_processor_dict(folder)
        if found is not None:
            values.update(file_values(*found, top_level_pixels=top_level_pixels))
    for name, reason in refused.items():
        if getattr(overrides, name) is not None:
            raise UserError(f"{FLAG_OF[name]} is not implemented for {processor}: {reason}")
    given = {name: getattr(overrides, name) for name in ("fps", "min_frames", "max_frames")
             if getattr(overrides, name) is not None}
    values.update(given)
    if given:
        values["sample_frames"] = True
    if overrides.max_frames is not None and overrides.min_frames is None:
        values["min_frames"] = min(values["min_frames"], overrides.max_frames)
    pixels = overrides.total_pixels if total_pixels_budget else overrides.max_pixels
    if pixels is not None:
        values["max_pixels"] = pixels
    values["folder_fps"] = overrides.folder_fps
    values["fps"] = float(values["fps"])
    return VideoSettings(processor=processor, **values)


def check_frames(total: int, src_fps: float) -> None:
    """Refuse (``ValueError``) a video of no frame or a rate that is not positive."""
    if total < 1:
        raise ValueError(f"frame sampling: a video needs at least one frame, got {total}")
    if not src_fps > 0:
        raise ValueError(f"frame sampling: source fps must be positive, got {src_fps}")


def temporal_padded(indices: Sequence[int], temporal_patch_size: int) -> list[int]:
    """``indices`` with the last repeated up to a multiple of ``temporal_patch_size``: the frames a ViT's
    temporal patches see."""
    out = list(indices)
    out += [out[-1]] * (-len(out) % temporal_patch_size)
    return out


__all__ = ["DEFAULT_VIDEO_FPS", "FLAG_OF", "VideoOverrides", "VideoSettings", "video_settings",
           "video_processor_dict", "file_values", "check_frames", "temporal_padded"]
