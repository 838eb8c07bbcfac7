"""A small local evaluation task whose right answers are known: flat-colour images, each asked "x" (the stand-in
generator answers ``image 16x16 rgb(R,G,B) x``).  Every other record's reference is that answer written in upper
case with a full stop and spaces around it (right once normalised), the rest a wrong one."""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

SIDE = 16


def write_colour_task(folder: Path, samples: int = 24) -> tuple[Path, list[bool]]:
    """The task JSONL (records with ``<image>`` tags, images relative to it) and which records are right."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    right = []
    with open(folder / "task.jsonl", "w") as f:
        for k in range(samples):
            rgb = (10 * k % 256, 255 - 7 * k, 3 * k)
            Image.new("RGB", (SIDE, SIDE), rgb).save(folder / "images" / f"c{k}.png")
            said = f"image {SIDE}x{SIDE} rgb({rgb[0]},{rgb[1]},{rgb[2]}) x"
            right.append(k % 2 == 0)
            reference = f"  {said.upper()}. " if right[-1] else "a wrong answer"
            f.write(json.dumps({"messages": [{"role": "user", "content": "<image>x"},
                                             {"role": "assistant", "content": reference}],
                                "images": [f"images/c{k}.png"]}) + "\n")
    return folder / "task.jsonl", right
