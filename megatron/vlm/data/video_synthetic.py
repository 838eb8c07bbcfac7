"""H.264 test videos made with PyAV whose frames carry their own index, for tests and benchmarks.

Frame ``i`` shows ``i`` in binary as a 4 x 4 grid of black and white blocks (16 bits, most significant first,
row-major), coarse enough to survive H.264's loss at any size from 64 x 48 px up: ``frame_code`` reads it
back from a decoded frame, so a test compares indices, not pixels.  ``write_coded_video`` writes such a file
(optionally with an audio track, which readers must ignore), ``write_coded_folder`` a frame folder of PNGs.
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image

GRID = 4  # blocks per side: 16 bits, frame indices below 65536
BLACK, WHITE = 16, 235  # video-range levels: no clipping in YUV


def coded_frame(index: int, width: int, height: int) -> np.ndarray:
    """uint8 ``[height, width, 3]`` RGB frame showing ``index`` as 16 black/white blocks."""
    if not 0 <= index < 2 ** (GRID * GRID):
        raise ValueError(f"coded_frame: index {index} outside 0..{2 ** (GRID * GRID) - 1}")
    bits = [(index >> (GRID * GRID - 1 - b)) & 1 for b in range(GRID * GRID)]
    blocks = np.where(np.array(bits, dtype=bool).reshape(GRID, GRID), WHITE, BLACK).astype(np.uint8)
    rows = np.arange(height) * GRID // height
    cols = np.arange(width) * GRID // width
    return np.repeat(blocks[rows][:, cols][:, :, None], 3, axis=2)


def frame_code(frame: np.ndarray) -> int:
    """The index a ``coded_frame`` shows, read from the centre of each block (uint8 ``[h, w, 3]``)."""
    height, width = frame.shape[:2]
    value = 0
    for r in range(GRID):
        for c in range(GRID):
            y = (2 * r + 1) * height // (2 * GRID)
            x = (2 * c + 1) * width // (2 * GRID)
            value = (value << 1) | int(frame[y, x].mean() > (BLACK + WHITE) / 2)
    return value


def write_coded_video(path: str, num_frames: int, fps: int, width: int, height: int, *, gop: int | None = None,
                      faststart: bool = False, audio: bool = False, crf: int = 23) -> str:
    """Write an H.264 (libx264, yuv420p) file of ``num_frames`` coded frames at ``fps`` (an integer rate);
    ``gop``: frames between keyframes (x264's default 250 when None); ``faststart``: the index (mp4 ``moov``)
    before the data, so that a truncated copy still opens; ``audio``: add a silent AAC track.  Returns ``path``."""
    import av  # PyAV: a slow import, only when a video is written

    with av.open(path, "w", options={"movflags": "faststart"} if faststart else None) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        options = {"crf": str(crf)}
        if gop is not None:
            options.update(g=str(gop), keyint_min=str(gop), sc_threshold="0")
        stream.options = options
        sound = None
        if audio:
            sound = container.add_stream("aac", rate=16000)
            sound.layout = "mono"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(coded_frame(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            samples = int(16000 * num_frames / fps)
            chunk = 1024
            for start in range(0, samples, chunk):
                n = min(chunk, samples - start)
                audio_frame = av.AudioFrame.from_ndarray(np.zeros((1, n), dtype=np.float32), format="fltp",
                                                         layout="mono")
                audio_frame.sample_rate = 16000
                audio_frame.pts = start
                for packet in sound.encode(audio_frame):
                    container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    return path


def write_coded_folder(folder: str, num_frames: int, width: int, height: int, name: str = "frame_{}.png") -> str:
    """A frame folder of ``num_frames`` coded PNGs named ``name.format(i)`` (unpadded numbers by default, so that
    name order must compare digits as numbers).  Returns ``folder``."""

    os.makedirs(folder, exist_ok=True)
    for i in range(num_frames):
        Image.fromarray(coded_frame(i, width, height)).save(os.path.join(folder, name.format(i)))
    return folder
