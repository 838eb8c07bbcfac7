"""Per-sample length statistics in OmniBal's format, from the reader's validation pass (no pixel decode).

Output: a JSON list, one entry per dataset sample in dataset order (``repeat_time`` applied)::

    {"vit_num": ViT items fed (the rule's dummy items for text-only), "token_num": tokens,
     "image_flags": ViT items of real images}

``image_stats_records`` adds each image (``omnibal isf stats --write``): ``"images": [{"width": px, "height": px,
UNIT: ViT items}, ...]`` with UNIT the family's (``ImageRule.unit``: "tiles", "patches").
"""
from __future__ import annotations

import json
import os

from .images import ImageRule
from .records import ReaderConfig, scan_annotations


def stats_records(scan) -> list[dict]:
    """The stats entries of a ``ScanResult``, in dataset order."""
    order = scan.order
    items, tokens, real = scan.rec_items[order], scan.rec_tokens[order], scan.rec_real_items[order]
    return [{"vit_num": int(v), "token_num": int(t), "image_flags": int(f)} for v, t, f in zip(items, tokens, real)]


def image_stats_records(scan, unit: str) -> list[dict]:
    """``{"vit_num", "token_num", "images"}`` per sample of a ``ScanResult`` (dataset order): the ViT items fed, the
    tokens, and each kept image's width and height (px) and its ViT items under the key ``unit``."""
    out = []
    for r in scan.order:
        lo = int(scan.img_ptr[r])
        images = [{"width": int(scan.img_width[i]), "height": int(scan.img_height[i]), unit: int(scan.img_items[i])}
                  for i in range(lo, lo + int(scan.rec_images_kept[r]))]
        out.append({"vit_num": int(scan.rec_items[r]), "token_num": int(scan.rec_tokens[r]), "images": images})
    return out


def write_json(records: list, out_path: str) -> None:
    """``records`` as JSON at ``out_path`` (folders made; a temporary file renamed)."""
    folder = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(folder, exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f)
    os.replace(tmp, out_path)


def write_stats(meta_path: str, out_path: str, tokenizer, images: ImageRule, *, max_seq_length: int | None = None,
                truncate: bool = False, system: str | None = None, progress: bool = True) -> int:
    """Scan ``meta_path`` (validating it) with the image rule ``images`` and write its stats JSON to ``out_path``;
    returns the sample count.

    The reader options must match the training run's for the numbers to match its samples.
    """
    config = ReaderConfig(images=images, max_seq_length=max_seq_length, truncate=truncate, system=system)
    scan = scan_annotations(meta_path, tokenizer, config, progress=progress)
    records = stats_records(scan)
    write_json(records, out_path)
    return len(records)
