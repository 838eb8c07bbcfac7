"""Per-sample length statistics in OmniBal's format, from the reader's validation pass (no pixel decode).

Output: a JSON list, one entry per dataset sample in dataset order (``repeat_time`` applied)::

    {"vit_num": ViT items fed (the rule's dummy items for text-only), "token_num": tokens,
     "image_flags": ViT items of real images}

``image_stats_records`` adds each image (``omnibal isf stats --write``): ``"images": [{"width": px, "height": px,
UNIT: ViT items}, ...]`` with UNIT the family's (``ImageRule.unit``: "tiles", "patches"), and where the data has
videos each video: ``"videos": [{"frames": sampled, "width": px, "height": px, "patches": ViT items, "temporal":
attention segments in time}]`` (``omnibal_ext.data.stats``; a video's blocks are not among the images).
"""
from __future__ import annotations

import json
import os

from .images import ImageRule
from .records import ReaderConfig, scan_annotations, scan_media


def stats_records(scan) -> list[dict]:
    """The stats entries of a ``ScanResult``, in dataset order."""
    order = scan.order
    items, tokens, real = scan.rec_items[order], scan.rec_tokens[order], scan.rec_real_items[order]
    return [{"vit_num": int(v), "token_num": int(t), "image_flags": int(f)} for v, t, f in zip(items, tokens, real)]


def image_stats_records(scan, unit: str) -> list[dict]:
    """``{"vit_num", "token_num", "images"[, "videos"]}`` per sample of a ``ScanResult`` (dataset order): the ViT
    items fed, the tokens, each kept image's width and height (px) and its ViT items under the key ``unit``, and
    (when some sample keeps a video) each kept video's frames, size, ViT items and temporal patches
    (``records.scan_media``)."""
    images, videos = scan_media(scan)
    out = []
    for i, r in enumerate(scan.order):
        lo, hi = images.offsets[i], images.offsets[i + 1]
        rec = {"vit_num": int(scan.rec_items[r]), "token_num": int(scan.rec_tokens[r]),
               "images": [{"width": int(images.width[k]), "height": int(images.height[k]), unit: int(images.patches[k])}
                          for k in range(lo, hi)]}
        if videos is not None:
            rec["videos"] = [{"frames": int(videos.frames[k]), "width": int(videos.width[k]),
                              "height": int(videos.height[k]), "patches": int(videos.patches[k]),
                              "temporal": int(videos.temporal[k])}
                             for k in range(videos.offsets[i], videos.offsets[i + 1])]
        out.append(rec)
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
