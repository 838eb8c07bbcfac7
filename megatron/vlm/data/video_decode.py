"""Video decoding for the data loader's workers: a file with PyAV, or a frame folder with PIL.

A video is read in two steps, so that the sampler can choose frames from the metadata alone:

1. ``probe_video(path)`` -> ``VideoInfo``: frame rate, frame count, duration and size, from the container's
   header (nothing is decoded; a header without a frame count, as mkv and webm write them: the stream's packets
   are counted, still without decoding).  A *frame folder* (a directory of images, one per frame, in name order) has no
   frame rate: it is given one (``folder_fps``, 24 by default, the rate transformers assumes).
2. ``decode_frames(path, info, indices)`` -> ``DecodedFrames``: only the frames asked for, as RGB uint8.

Frame ``i`` of a file is the frame on screen at ``i / fps`` s after the stream's start (its presentation time
stamp, in frames from the start, rounded); for the constant-rate files of training sets this is the ``i``-th
decoded frame, as transformers counts them.  Decoding seeks to the keyframe at or before the first wanted frame,
decodes forward and stops after the last wanted one; when the next wanted frame is more than ``reseek_gap_s``
seconds ahead, it seeks again.  An 8-s clip of a long file thus decodes about 8 s plus one keyframe interval.
Only the first video stream is read; audio and every other stream are ignored (not even demuxed).

A video is a file path, a frame folder, or ``VideoBytes``: a file's bytes held in memory (an Energon sample's
member), named in errors by its ``name``.

Bad input raises ``VideoError`` (a ``UserError``) naming the file, after ``where`` (a record's ``file:line``)
when the caller gives it: a missing or unreadable file, no video stream, a file that ends (or breaks) before
a wanted frame (truncated), no decodable frame; a folder without images, an unreadable image, images of
different sizes.  The reader catches ``VideoError`` to skip the sample under ``--skip-bad-samples``.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from omnibal_ext.errors import UserError

from .rgb import to_rgb

DEFAULT_FOLDER_FPS = 24.0  # transformers' assumption for frames without a rate (its video processors' default)
DEFAULT_RESEEK_GAP_S = 5.0  # seek again when the next wanted frame is further ahead than this
END_SLACK_FRAMES = 2  # a header may count a frame or two past the last time stamp; more is truncation


class VideoError(UserError):
    """A video (file or frame folder) that cannot be read as asked: the message names the file."""


@dataclass(frozen=True)
class VideoInfo:
    """What the sampler needs of one video, read without decoding.

    ``fps``: frames per second of the source (a frame folder: the ``folder_fps`` it was probed with);
    ``num_frames``: frames in the stream (the header's count, else duration x fps rounded); ``duration_s``:
    ``num_frames / fps`` s; ``width`` x ``height`` in px; ``is_folder``: a directory of images.
    """

    path: str
    fps: float
    num_frames: int
    width: int
    height: int
    is_folder: bool = False

    @property
    def duration_s(self) -> float:
        """Length in seconds: ``num_frames / fps``."""
        return self.num_frames / self.fps


@dataclass(frozen=True)
class DecodedFrames:
    """Frames decoded for one sampler's request.

    ``frames``: uint8 ``[len(indices), height, width, 3]`` RGB, in the order of ``indices`` (a repeated index
    gives the same frame twice); ``indices``: the frame indices asked for; ``decoded``: frames the decoder
    produced to serve them (images opened, for a folder), the cost that seeking keeps low.
    """

    frames: np.ndarray
    indices: tuple[int, ...]
    decoded: int


@dataclass(frozen=True)
class VideoBytes:
    """A video file's bytes held in memory (an Energon sample's member); ``name`` names it in errors (e.g.
    ``shard-000.tar/key.video.mp4``)."""

    name: str
    data: bytes

    def __str__(self) -> str:
        return self.name


VideoPath = str | VideoBytes  # a file, a frame folder, or a file's bytes


def _name(path: VideoPath, where: str | None) -> str:
    return f"{where}: video {path}" if where else f"video {path}"


def is_frame_folder(path: VideoPath) -> bool:
    """Whether ``path`` is a frame folder (a directory) rather than a video file."""
    return isinstance(path, str) and os.path.isdir(path)


def _open(path: VideoPath):
    """The PyAV container of a file or of a file's bytes."""
    import io

    import av

    return av.open(io.BytesIO(path.data) if isinstance(path, VideoBytes) else path)


def count_packets(container, stream) -> int:
    """Packets of ``stream`` (one per frame in the containers that omit the count), demuxed without decoding;
    the empty packets that flush the demuxer are not frames."""
    return sum(1 for packet in container.demux(stream) if packet.size)


# ---------------------------------------------------------------------------------------------------- probing

def probe_video(path: VideoPath, folder_fps: float = DEFAULT_FOLDER_FPS, where: str | None = None) -> VideoInfo:
    """The ``VideoInfo`` of a video file (or its bytes) or frame folder; refuses (``VideoError``) what cannot be
    read."""
    if is_frame_folder(path):
        return _probe_folder(path, folder_fps, where)
    if not isinstance(path, VideoBytes) and not os.path.isfile(path):
        raise VideoError(f"{_name(path, where)}: no such file or directory")
    import av  # PyAV: a slow import, only when a video is read

    try:
        with _open(path) as container:
            stream = _video_stream(container, path, where)
            fps = _stream_fps(stream, path, where)
            num_frames = int(stream.frames or 0)
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            if num_frames <= 0:  # containers without a frame count (mkv, webm): its packets, none decoded
                num_frames = count_packets(container, stream)
    except av.FFmpegError as e:
        raise VideoError(f"{_name(path, where)}: unreadable ({_reason(e)})") from None
    if num_frames <= 0:
        raise VideoError(f"{_name(path, where)}: no frames (its header gives no frame count and its video stream "
                         "holds no packet)")
    if width <= 0 or height <= 0:
        raise VideoError(f"{_name(path, where)}: its video stream has no frame size ({width}x{height} px)")
    return VideoInfo(path=str(path), fps=fps, num_frames=num_frames, width=width, height=height)


def _reason(error: Exception) -> str:
    return " ".join(str(getattr(error, "strerror", None) or error).split())


def _video_stream(container, path: VideoPath, where: str | None):
    if not container.streams.video:
        raise VideoError(f"{_name(path, where)}: has no video stream")
    return container.streams.video[0]


def _stream_fps(stream, path: VideoPath, where: str | None) -> float:
    rate = stream.average_rate or stream.guessed_rate  # transformers reads average_rate
    if not rate or float(rate) <= 0:
        raise VideoError(f"{_name(path, where)}: its video stream has no frame rate")
    return float(rate)


def _natural_key(name: str) -> list:
    """Name order with digit runs compared as numbers (``f2.jpg`` before ``f10.jpg``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def folder_frame_files(path: str, where: str | None = None) -> list[str]:
    """The image files of a frame folder in frame order: names with an image extension PIL opens, sorted by
    name (digit runs as numbers, so ``frame_2`` precedes ``frame_10``); refuses a folder without any."""
    extensions = set(Image.registered_extensions())
    names = [n for n in os.listdir(path)
             if os.path.splitext(n)[1].lower() in extensions and os.path.isfile(os.path.join(path, n))]
    if not names:
        raise VideoError(f"{_name(path, where)}: frame folder without images (zero decodable frames)")
    return [os.path.join(path, n) for n in sorted(names, key=_natural_key)]


def _probe_folder(path: str, folder_fps: float, where: str | None) -> VideoInfo:
    if not folder_fps > 0:
        raise VideoError(f"{_name(path, where)}: --video-folder-fps must be positive, got {folder_fps}")
    files = folder_frame_files(path, where)
    with _open_image(files[0], path, where) as image:  # reads the header only
        width, height = image.size
    return VideoInfo(path=path, fps=float(folder_fps), num_frames=len(files), width=width, height=height,
                     is_folder=True)


def _open_image(file: str, folder: str, where: str | None) -> Image.Image:
    try:
        return Image.open(file)
    except (UnidentifiedImageError, OSError) as e:
        raise VideoError(f"{_name(folder, where)}: frame {os.path.basename(file)} is unreadable ({_reason(e)})") from None


# --------------------------------------------------------------------------------------------------- decoding

def decode_frames(path: VideoPath, info: VideoInfo, indices: Sequence[int], where: str | None = None, *,
                  seek: bool = True, reseek_gap_s: float = DEFAULT_RESEEK_GAP_S, threads: int = 1) -> DecodedFrames:
    """The frames ``indices`` (``0 <= i < info.num_frames``, any order, repeats allowed) of the video probed as
    ``info``.  ``seek=False`` decodes from the start (for comparison); ``threads``: decoder threads (1 in a
    DataLoader worker, whose parallelism is the workers)."""
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        raise ValueError("decode_frames: no frame indices")
    if wanted[0] < 0 or wanted[-1] >= info.num_frames:
        raise ValueError(f"decode_frames: frame indices {wanted[0]}..{wanted[-1]} outside the video's "
                         f"{info.num_frames} frames")
    if info.is_folder:
        got, decoded = _decode_folder(path, wanted, where)
    else:
        got, decoded = _decode_file(path, info, wanted, where, seek, reseek_gap_s, threads)
    frames = np.stack([got[i] for i in indices])
    return DecodedFrames(frames=frames, indices=tuple(int(i) for i in indices), decoded=decoded)


def _decode_folder(path: str, wanted: list[int], where: str | None) -> tuple[dict[int, np.ndarray], int]:
    files = folder_frame_files(path, where)
    got: dict[int, np.ndarray] = {}
    size = None
    for i in wanted:
        try:
            with _open_image(files[i], path, where) as image:
                rgb = np.asarray(to_rgb(image))
        except OSError as e:  # truncated image data surfaces on load
            raise VideoError(f"{_name(path, where)}: frame {os.path.basename(files[i])} is unreadable "
                             f"({_reason(e)})") from None
        if size is None:
            size = rgb.shape
        elif rgb.shape != size:
            raise VideoError(f"{_name(path, where)}: frame {os.path.basename(files[i])} is {rgb.shape[1]}x"
                             f"{rgb.shape[0]} px, the folder's earlier frames {size[1]}x{size[0]} px")
        got[i] = rgb
    return got, len(wanted)


def _decode_file(path: VideoPath, info: VideoInfo, wanted: list[int], where: str | None, seek: bool,
                 reseek_gap_s: float, threads: int) -> tuple[dict[int, np.ndarray], int]:
    import av  # PyAV: a slow import, only when a video is read

    got: dict[int, np.ndarray] = {}
    decoded = 0
    try:
        with _open(path) as container:
            stream = _video_stream(container, path, where)
            stream.thread_count = max(1, int(threads))
            time_base = stream.time_base or Fraction(1, 1)
            start = stream.start_time or 0
            frames_per_tick = float(time_base) * info.fps

            def position(frame) -> float:  # frames since the stream's start
                return (frame.pts - start) * frames_per_tick

            def seek_to(index: int) -> None:  # the keyframe at or before frame `index` (half a frame early)
                ticks = start + max(0, math.floor((index - 0.5) / frames_per_tick))
                container.seek(ticks, stream=stream, backward=True, any_frame=False)

            k = 0  # next wanted frame: wanted[k]
            sought = seek and wanted[0] > 0  # a seek happened: time stamps place the frames
            target = wanted[0] if sought else 0  # the frame the last seek was for
            if sought:
                seek_to(target)
            restarted = False
            p = -math.inf  # position of the last decoded frame
            last = None  # the last decoded frame
            while k < len(wanted):
                previous = None  # the frame decoded before `frame`, since the last seek
                jump = None  # where to seek next (0: the start)
                for frame in container.decode(stream):
                    decoded += 1
                    if frame.pts is None:  # no time stamps: count frames from the start
                        if seek:
                            raise _NoTimestamps
                        p = float(decoded - 1)
                    else:
                        p = position(frame)
                    while k < len(wanted) and p > wanted[k] + 0.5:  # wanted[k] was on screen before `frame`
                        if previous is not None:
                            got[wanted[k]] = previous.to_ndarray(format="rgb24")
                        elif sought and not restarted:  # the seek landed after it: decode from the start
                            jump = 0
                            break
                        else:  # nothing earlier exists: `frame` is the first on screen
                            got[wanted[k]] = frame.to_ndarray(format="rgb24")
                        k += 1
                    if jump is not None:
                        break
                    while k < len(wanted) and p >= wanted[k] - 0.5:
                        got[wanted[k]] = frame.to_ndarray(format="rgb24")
                        k += 1
                    last = frame
                    if k == len(wanted):
                        break
                    if seek and wanted[k] != target and (wanted[k] - p) / info.fps > reseek_gap_s:
                        jump = target = wanted[k]
                        break
                    previous = frame
                if jump is None:
                    break  # all served, or the end of the stream
                sought = True
                if jump == 0:
                    restarted = True
                    container.seek(start, stream=stream, backward=True, any_frame=False)
                else:
                    seek_to(jump)
            # frames a header counts past the last time stamp (at most END_SLACK_FRAMES): the last frame
            while k < len(wanted) and last is not None and wanted[k] <= p + END_SLACK_FRAMES:
                got[wanted[k]] = last.to_ndarray(format="rgb24")
                k += 1
    except _NoTimestamps:
        return _decode_file(path, info, wanted, where, False, reseek_gap_s, threads)
    except av.FFmpegError as e:
        if decoded == 0:
            raise VideoError(f"{_name(path, where)}: unreadable, zero decodable frames ({_reason(e)})") from None
        raise VideoError(f"{_name(path, where)}: truncated or corrupt: decoding failed after {decoded} frames, "
                         f"before frame {wanted[len(got)] if len(got) < len(wanted) else wanted[-1]} of its "
                         f"{info.num_frames} ({_reason(e)})") from None
    if decoded == 0:
        raise VideoError(f"{_name(path, where)}: zero decodable frames (its header promises {info.num_frames})")
    missing = [i for i in wanted if i not in got]
    if missing:
        raise VideoError(f"{_name(path, where)}: truncated: its header promises {info.num_frames} frames at "
                         f"{info.fps:g} fps, the stream ends before frame {missing[0]}")
    return got, decoded


class _NoTimestamps(Exception):
    """Frames without presentation time stamps after a seek: decode again from the start, counting frames."""
