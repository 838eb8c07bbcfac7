"""A cache of validation scans, so a restarted job (``torchrun --max-restarts``, a resumed run) does not decode
every image again.

One ``.npz`` per scan under the cache folder, named by a key over everything the scan's result depends on:
the meta file's bytes, each annotation's path, size and modification time, the reader configuration and the
tokenizer (its description, vocabulary size, chat template and the sizes and times of its files). Images are
not in the key: a scan trusts the images it decoded (the loader still checks each image's size against the
scan's); after changing images in place without touching the annotations, delete the cache folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

FORMAT = 4  # 2: the reader configuration holds the image rule; items, not tiles. 3: the video rule, video blocks.
# 4: each entry's video, frames and temporal patches
_ARRAYS = ("rec_source", "rec_offset", "rec_line", "img_ptr", "img_width", "img_height", "img_items", "img_video",
           "img_frames", "img_temporal", "rec_tokens",
           "rec_images_kept", "rec_real_items", "rec_items", "order")


def described_rule(rule) -> list | None:
    """A family's image or video rule as the key holds it: its type and settings (a dataclass's fields, else its
    repr); None for no rule."""
    if rule is None:
        return None
    return [type(rule).__qualname__, dataclasses.asdict(rule) if dataclasses.is_dataclass(rule) else repr(rule)]


def scan_key(meta_path: str, sources, config, tokenizer) -> str:
    """Hex digest naming the scan of ``meta_path`` under ``config`` with ``tokenizer``."""
    def stat(path: str) -> list:
        st = os.stat(path)
        return [os.path.abspath(path), st.st_size, st.st_mtime_ns]

    tok_dir = getattr(tokenizer, "path", None)
    tok_files = sorted(stat(os.path.join(tok_dir, f)) for f in os.listdir(tok_dir)) if tok_dir else []

    with open(meta_path, "rb") as f:
        meta_digest = hashlib.sha256(f.read()).hexdigest()
    described = {
        "format": FORMAT,
        "meta": meta_digest,
        "annotations": [stat(src.annotation) for src in sources],
        "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                   if f.name not in ("images", "videos") and (getattr(config, f.name) or f.name != "skip_bad")},
        "images": described_rule(config.images),
        "videos": described_rule(config.videos),
        "tokenizer": [repr(tokenizer), tokenizer.vocab_size, getattr(tokenizer, "chat_template", None), tok_files],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_path(cache_dir: str, meta_path: str, key: str) -> str:
    name = os.path.splitext(os.path.basename(meta_path))[0]
    return os.path.join(cache_dir, f"scan_{name}_{key}.npz")


def load_scan(path: str) -> dict | None:
    """The fields of the ScanResult cached at ``path`` (all but ``sources``), or None when there is none (or it
    cannot be read: it is rebuilt)."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in _ARRAYS}
            num_truncated, num_without_loss = (int(v) for v in z["counts"])
            skipped = tuple(str(m) for m in z["skipped"]) if "skipped" in z.files else ()
    except (OSError, KeyError, ValueError):
        return None
    return {**arrays, "num_truncated": num_truncated, "num_without_loss": num_without_loss, "skipped": skipped}


def save_scan(path: str, scan) -> None:
    """Write ``scan`` to ``path`` atomically (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, counts=np.array([scan.num_truncated, scan.num_without_loss], np.int64),
             skipped=np.array(list(scan.skipped), dtype=str),
             **{name: getattr(scan, name) for name in _ARRAYS})
    os.replace(tmp, path)
