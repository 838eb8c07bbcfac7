"""A photo-and-video JSONL for the Energon tests (no download): crops of scikit-learn's two sample photographs (JPEG
and PNG, up to 640 x 427 px, ``hf_tiny_qwen.photos``) and H.264 clips made with PyAV here, in every record form the
reader takes (``messages`` with tags and with typed parts, ``conversations`` with an image list and a video, a
text-only record), and the Energon readers' view of it."""
from __future__ import annotations

import json
from pathlib import Path

import hf_tiny_qwen

from megatron.vlm.data.video_synthetic import write_coded_video

CLIPS = (("c0.mp4", 12, 6, 64, 48), ("c1.mp4", 20, 10, 96, 64), ("c2.mp4", 9, 3, 80, 48))  # name, frames, fps, w, h


def records(pics: list[tuple[str, str]]) -> list[dict]:
    """The records over ``pics`` ((file, subject) pairs) and ``CLIPS``: every form, each answer naming its media."""
    out = []
    for k, (name, subject) in enumerate(pics):
        if k % 3 == 0:
            out.append({"messages": [{"role": "user", "content": "<image>What is shown?"},
                                     {"role": "assistant", "content": subject}], "images": [name]})
        elif k % 3 == 1:
            out.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "Name it:"},
                                                                  {"type": "image", "image": name}]},
                                     {"role": "assistant", "content": [{"type": "text", "text": subject}]}]})
        else:
            other = pics[(k + 1) % len(pics)][0]
            out.append({"id": k, "image": [name, other],
                        "conversations": [{"from": "human", "value": "<image> and <image>?"},
                                          {"from": "gpt", "value": f"{subject} first"}]})
    for k, (name, frames, fps, *_ ) in enumerate(CLIPS):
        if k % 2:
            out.append({"video": name, "conversations": [{"from": "human", "value": "What moves?"},
                                                          {"from": "gpt", "value": f"clip {k}"}]})
        else:
            out.append({"messages": [{"role": "user", "content": [{"type": "video", "video": name},
                                                                  {"type": "text", "text": "Which clip?"}]},
                                     {"role": "assistant", "content": f"clip {k}"}]})
    out.append({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]})
    return out


def write_data(folder: Path, shapes=((0, 0, 640, 427), (100, 50, 420, 410), (300, 0, 380, 427)),
               copies: int = 1) -> str:
    """The media and ``train.jsonl`` (``records``, ``copies`` times over: the same media, each copy's records a
    line of their own) in ``folder``; returns the JSONL's path."""
    folder.mkdir(parents=True, exist_ok=True)
    pics = hf_tiny_qwen.photos(folder, shapes)
    for name, frames, fps, width, height in CLIPS:
        write_coded_video(str(folder / name), frames, fps, width, height, gop=4)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for _ in range(copies) for r in records(pics)))
    return str(path)


def line_of(name: str) -> int:
    """The 1-based annotation line of a converted sample from its ``shard.tar/s000-<line>`` name."""
    return int(name.rsplit("-", 1)[-1])
