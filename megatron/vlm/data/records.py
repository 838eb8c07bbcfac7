"""Reader and map-style dataset of instruction data (``conversations`` and ``messages`` records), for every family.

Meta JSON (paths relative to the meta file's folder unless absolute), or one annotation JSONL given directly
(a single source, images relative to the JSONL's folder)::

    {"name": {"root": "images/", "annotation": "train.jsonl", "repeat_time": 1.0, "length": 1234}, ...}

``repeat_time`` (default 1, > 0): ``floor(r)`` whole copies of the annotation plus ``round(frac(r) * lines)``
lines drawn without replacement (seeded, kept in file order).  ``length``, when given, must equal the
number of records in the annotation (a stale meta is an error, not a silent skip).  Sources are
concatenated in meta order.

Annotation JSONL, one record per non-blank line, in either format (a file may mix them)::

    {"id": ..., "image": "a.png" | ["a.png", "b.png"] | absent, "conversations": [{"from": "human", ...}, ...]}
    {"id": ..., "video": "v.mp4" | "frames/", "clip": [start_s, end_s] (optional), "conversations": [...]}
    {"messages": [{"role": "user", "content": "<image>..." | [{"type": "image", "image": "a.png"}, ...]}, ...],
     "images": ["a.png", ...], "videos": ["v.mp4", ...]}                                        (messages.py)

A video is a file PyAV reads or a frame folder (a directory of images, ``--video-folder-fps``); in a
``conversations`` record it is the ``<video>`` tag (one is put before the first question when there is none,
as the conversations format's reference code does) and a ``clip`` cuts it.  How a video becomes ViT items and
text is the family's video rule (``ReaderConfig.videos``, a ``VideoRule`` of ``video.py``): the rule's frames are
taken (from the header and a seed per record and video, ``video_seed``), its text replaces the ``<video>`` tag,
holding one ``<image>`` block per item group; its blocks are counted like images' (``img_*`` entries: each block
one entry of the source frame size) and kept or dropped whole by truncation.  The validation scan decodes every video's
sampled frames (a truncated or corrupt file is caught there); ``__getitem__`` (in the DataLoader's workers)
decodes them again.  A family without a video rule refuses video records (``--skip-bad-samples`` leaves them out).

Validation happens in one pass at construction (``scan_annotations``), before any training: every record
is parsed, its images are decoded once (``PIL.Image.open(...).load()``, JPEGs at 1/8 scale: the whole
compressed stream is still read, see ``decoded_size``; a truncated or corrupt file whose header reads fine is
caught here, not in the middle of training; this is the scan's main cost, about one image decode per image
reference, the pixels are not kept), its ViT items and its exact token count are
computed with the same code ``__getitem__`` uses.  An annotation file without any record is an error too.
In a distributed run the processes split the records (every world-th line) and all-gather what they
found, so each decodes 1/world of the images; the result is the one-process scan's.
All problems are collected and raised together as ``DataValidationError`` whose lines start with
``annotation:line`` (or ``annotation`` and the meta entry for an empty file).

How an image becomes ViT items and LLM image tokens is the family's image rule (``ReaderConfig.images``, an
``ImageRule`` of ``images.py``; ``TileImages``: dynamic tiling); the reader holds no rule's settings.

Truncation (``truncate=True``): a sample longer than ``max_seq_length`` is cut at that length, but an
image block is never split: the cut moves before the first image block that does not fit, and that image
and the later ones (their items too) are dropped.  Text-only samples get the rule's dummy items
(``dummy_pixels``) with ``image_flags`` 0 and no image-context tokens.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from tqdm import tqdm

from omnibal_ext.data.stats import ImageStats, SampleStats, VideoStats
from omnibal_ext.errors import UserError

from . import scan_cache
from .images import ImageRule
from .record_sample import (FileMedia, ReaderConfig, RecordLayout, RecordProblems, RecordVideo, VideoPlan,
                            image_flags, layout_record, media_entries, media_order, plan_videos, record_turns,
                            sample_pixels, sample_text)
from .rgb import mode_problem
from .template import plan_conversation
from .video import VideoRule
from .video_decode import decode_frames

__all__ = ["DataValidationError", "FileMedia", "ReaderConfig", "RecordDataset", "RecordLayout", "RecordVideo",
           "ScanResult", "SourceSpec", "VideoPlan", "media_entries", "media_order", "plan_videos", "read_meta",
           "record_turns", "scan_annotations", "scan_media"]

MAX_LISTED_ERRORS = 20


class DataValidationError(UserError):
    """Problems found in the data before training; each message line names ``file:line``."""


@dataclass(frozen=True)
class SourceSpec:
    """One entry of the meta JSON, with paths resolved."""

    name: str
    root: str
    annotation: str
    repeat_time: float = 1.0
    length: int | None = None


def read_meta(meta_path: str) -> list[SourceSpec]:
    """Parse and check the meta JSON, or make the one source of an annotation JSONL (see module docstring)."""
    if meta_path.endswith(".jsonl"):
        if not os.path.isfile(meta_path):
            raise DataValidationError(f"{meta_path}: annotation file not found")
        path = os.path.normpath(os.path.abspath(meta_path))
        return [SourceSpec(os.path.splitext(os.path.basename(path))[0], os.path.dirname(path), path)]
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataValidationError(f"{meta_path}: meta file not found") from None
    except json.JSONDecodeError as e:
        raise DataValidationError(f"{meta_path}:{e.lineno}: meta file is not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict) or not meta:
        raise DataValidationError(f"{meta_path}: meta must be a non-empty JSON object {{name: {{root, annotation}}}}")
    base = os.path.dirname(os.path.abspath(meta_path))
    sources = []
    for name, entry in meta.items():
        where = f"{meta_path}: entry {name!r}"
        if not isinstance(entry, dict) or "annotation" not in entry:
            raise DataValidationError(f"{where}: needs at least an 'annotation' path")
        annotation = os.path.normpath(os.path.join(base, entry["annotation"]))
        root = os.path.normpath(os.path.join(base, entry.get("root", "")))
        if not os.path.isfile(annotation):
            raise DataValidationError(f"{where}: annotation file not found: {annotation}")
        try:
            repeat = float(entry.get("repeat_time", 1.0))
        except (TypeError, ValueError):
            raise DataValidationError(f"{where}: repeat_time must be a number") from None
        if not (repeat > 0 and math.isfinite(repeat)):
            raise DataValidationError(f"{where}: repeat_time must be > 0, got {repeat}")
        length = entry.get("length")
        if length is not None and (not isinstance(length, int) or length < 0):
            raise DataValidationError(f"{where}: length must be a non-negative integer")
        sources.append(SourceSpec(name, root, annotation, repeat, length))
    return sources



@dataclass
class ScanResult:
    """Everything the validation pass learned, per record (M records) and per dataset sample (N)."""

    sources: list[SourceSpec]
    rec_source: np.ndarray  # int64 [M] source index
    rec_offset: np.ndarray  # int64 [M] byte offset of the line in its annotation
    rec_line: np.ndarray  # int64 [M] 1-based line number
    img_ptr: np.ndarray  # int64 [M+1] record r's images are img_*[img_ptr[r]:img_ptr[r+1]]
    img_width: np.ndarray  # int64 [I] px
    img_height: np.ndarray  # int64 [I] px
    img_items: np.ndarray  # int64 [I] ViT items of each image (the rule's)
    # per entry (an image, or a video's block; ``media_entries``): 0 for an image, else the video's 1-based ordinal
    # in its record, its sampled frames and its temporal patches (the ViT's attention segments in time)
    img_video: np.ndarray  # int64 [I]
    img_frames: np.ndarray  # int64 [I]
    img_temporal: np.ndarray  # int64 [I]
    rec_tokens: np.ndarray  # int64 [M] tokens after truncation
    rec_images_kept: np.ndarray  # int64 [M] images surviving truncation
    rec_real_items: np.ndarray  # int64 [M] ViT items of the kept images (= image_flags.sum())
    rec_items: np.ndarray  # int64 [M] items fed to the ViT (the rule's dummy items when no image is kept)
    order: np.ndarray  # int64 [N] record index of each dataset sample (repeat_time applied)
    num_truncated: int
    num_without_loss: int  # truncated samples left with no answer token
    skipped: tuple = ()  # with skip_bad: "file:line: reason" of every problem of the records left out

    def where(self, record: int) -> str:
        return f"{self.sources[self.rec_source[record]].annotation}:{self.rec_line[record]}"


def scan_media(scan: ScanResult) -> tuple[ImageStats, VideoStats | None]:
    """The kept images and videos of every dataset sample of ``scan`` (dataset order): each image's width, height
    (px) and ViT items; each video's sampled frames, frame width and height (px), ViT items (its blocks' sum) and
    temporal patches (None when no sample keeps a video)."""
    n = len(scan.order)
    kept = scan.rec_images_kept[scan.order]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(kept, out=offsets[1:])
    take = np.repeat(scan.img_ptr[scan.order] - offsets[:-1], kept) + np.arange(offsets[-1])
    sample = np.repeat(np.arange(n, dtype=np.int64), kept)  # the dataset sample of each kept entry
    video = scan.img_video[take]
    is_image = video == 0

    def csr(mask_sample: np.ndarray) -> np.ndarray:
        out = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(mask_sample, minlength=n), out=out[1:])
        return out

    im = take[is_image]
    images = ImageStats(csr(sample[is_image]), scan.img_width[im], scan.img_height[im], scan.img_items[im])
    if is_image.all():
        return images, None
    vid = np.flatnonzero(~is_image)
    # a video's blocks are consecutive entries of one sample with one ordinal: a new video starts where either changes
    first = vid[np.r_[True, (np.diff(vid) != 1) | (np.diff(video[vid]) != 0) | (np.diff(sample[vid]) != 0)]]
    items = np.add.reduceat(scan.img_items[take[vid]], np.searchsorted(vid, first))
    heads = take[first]
    videos = VideoStats(csr(sample[first]), scan.img_frames[heads], scan.img_width[heads], scan.img_height[heads],
                        items, scan.img_temporal[heads])
    return images, videos


def decoded_size(path: str) -> tuple[int, int]:
    """(width, height) of the image at ``path`` after decoding all of its pixels (raises on a truncated
    or corrupt file, the header alone can read fine, and on pixels ``rgb.to_rgb`` does not read).

    A JPEG is decoded in PIL's draft mode at 1/8 scale (libjpeg's scaled IDCT): the size is the one its header
    gives, read before the draft, and the decode still reads and entropy-decodes the whole compressed stream, so
    a truncated file ("image file is truncated") or corrupt entropy data ("broken data stream") raises exactly as
    in a full decode; only the full-size inverse DCT and colour conversion are skipped (about 3x faster on photos,
    the scan's main cost).  Other formats are decoded in full."""
    with Image.open(path) as im:
        size = im.size
        if im.format == "JPEG":
            im.draft(im.mode, (max(1, size[0] // 8), max(1, size[1] // 8)))
        im.load()
        problem = mode_problem(im.mode)
        if problem:
            raise ValueError(problem)
        return size


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://|^data:")


def url_problem(kind: str, path: str) -> str | None:
    """Why a record's ``kind`` ("image", "video") path is refused when it is a URL (none is fetched), else None."""
    if _URL.match(path):
        return (f"{kind} {path[:80]}: a URL, and URLs are not fetched: download the file and give its path (relative "
                "to the data folder)")
    return None


def _repeat_indices(n: int, repeat: float, rng: np.random.Generator) -> np.ndarray:
    whole = int(math.floor(repeat))
    extra = int(round((repeat - whole) * n))
    parts = [np.tile(np.arange(n, dtype=np.int64), whole)]
    if extra:
        parts.append(np.sort(rng.choice(n, size=extra, replace=False)).astype(np.int64))
    return np.concatenate(parts)


@dataclass
class ScanShare:
    """What one process of a split scan found: the records it owns (every ``world``-th non-blank line of each
    annotation, from ``rank`` on) and the line counts every process sees alike."""

    records: np.ndarray  # int64 [m, 7]: source, byte offset, line, tokens, images kept, real items, items fed
    images: np.ndarray  # int64 [i, 6]: width px, height px, ViT items, video, frames, temporal (media_entries);
    # the records' entries in record order
    images_per_record: np.ndarray  # int64 [m]
    errors: list  # (source index, line, k-th problem of the line, message)
    nonblank_lines: list  # [sources] non-blank lines of each annotation
    num_truncated: int = 0
    num_without_loss: int = 0


def scan_annotations(meta_path: str, tokenizer, config: ReaderConfig, progress: bool = True,
                     group=None, cache_dir: str | None = None) -> ScanResult:
    """The one validation pass over every annotation of ``meta_path`` (see module docstring).

    group: a torch.distributed process group whose processes split the records between them (each decodes
    1/world of the images) and all-gather what they found; every process gets the same ScanResult, equal
    to a scan in one process. None: this process scans everything.
    cache_dir: where finished scans are kept (megatron/vlm/data/scan_cache.py): a scan of the same
    annotations, configuration and tokenizer is read back instead of decoding every image again.
    """
    sources = read_meta(meta_path)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    path = cache = None
    if cache_dir:
        path = scan_cache.cache_path(cache_dir, meta_path, scan_cache.scan_key(meta_path, sources, config, tokenizer))
        fields = scan_cache.load_scan(path)
        cache = None if fields is None else ScanResult(sources, **fields)
        if world > 1:  # scan again unless every process can read it (e.g. a cache folder local to each node)
            found = [None] * world
            dist.all_gather_object(found, cache is not None, group=group)
            cache = cache if all(found) else None
    if cache is not None:
        if rank == 0:
            print(f"> data: the scan of {meta_path} is read from {path}", flush=True)
        result = cache
    else:
        share = scan_share(sources, tokenizer, config, rank, world, progress=progress and rank == 0)
        shares = [share]
        if world > 1:
            shares = [None] * world
            dist.all_gather_object(shares, share, group=group)
        result = merge_shares(meta_path, sources, shares, config)
        if path and rank == 0:
            scan_cache.save_scan(path, result)
    if result.num_truncated:
        warnings.warn(f"{meta_path}: {result.num_truncated} sample(s) truncated to max_seq_length "
                      f"{config.max_seq_length}; {result.num_without_loss} of them kept no answer token")
    return result


def scan_share(sources: list[SourceSpec], tokenizer, config: ReaderConfig, rank: int = 0, world: int = 1,
               progress: bool = False) -> ScanShare:
    """Process ``rank``'s share of the scan: every line is read (for offsets and line numbers, cheap), the
    records ``k % world == rank`` (k counting non-blank lines per annotation) are parsed, their images
    decoded and their tokens counted."""
    records, images, per_record, errors, nonblank = [], [], [], [], []
    num_truncated = num_without_loss = 0
    for s_idx, src in enumerate(sources):
        bar = tqdm(total=os.path.getsize(src.annotation), unit="B", unit_scale=True, desc=f"scan {src.name}",
                   disable=not progress, leave=False)
        with open(src.annotation, "rb") as f:
            offset = k = 0
            for line_no, raw in enumerate(f, start=1):
                line_offset, offset = offset, offset + len(raw)
                bar.update(len(raw))
                if not raw.strip():
                    continue
                k += 1
                if (k - 1) % world != rank:
                    continue
                found = _scan_record(raw, src, tokenizer, config, s_idx, line_no)
                if isinstance(found, list):
                    errors += [(s_idx, line_no, j, f"{src.annotation}:{line_no}: {msg}") for j, msg in enumerate(found)]
                    continue
                sizes, items, fields, tokens, kept, real, truncated, without_loss = found
                records.append((s_idx, line_offset, line_no, tokens, kept, real,
                                real if real > 0 else config.images.dummy_items))
                images += [(w, h, n, *f) for (w, h), n, f in zip(sizes, items, fields)]
                per_record.append(len(sizes))
                num_truncated += truncated
                num_without_loss += without_loss
            nonblank.append(k)
        bar.close()
    return ScanShare(np.asarray(records, np.int64).reshape(-1, 7), np.asarray(images, np.int64).reshape(-1, 6),
                     np.asarray(per_record, np.int64), errors, nonblank, num_truncated, num_without_loss)


def _scan_record(raw: bytes, src: SourceSpec, tokenizer, config: ReaderConfig, source: int = 0, line: int = 0):
    """One annotation line: ``(entry sizes, ViT items per entry, video fields per entry (``media_entries``), tokens,
    entries kept, real items, truncated, truncated without an answer token)`` (an entry: an image or a video's
    block), or its problems (a list of messages).  Every image and every sampled video frame is decoded once here
    (validation); the record's layout is ``record_sample.layout_record``'s, as the Energon reader's."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return [f"not valid JSON ({getattr(e, 'msg', e)})"]
    try:
        turns, images, videos = record_turns(record)
    except UserError as e:
        return [str(e)]
    media = FileMedia(src.root)
    sizes = []
    video_urls = [p for p in (url_problem("video", v.path) for v in videos) if p]
    problems = list(video_urls)
    for rel in images:
        path = media.image_name(rel)
        if url_problem("image", rel):
            problems.append(url_problem("image", rel))
            continue
        if os.path.isdir(path):
            problems.append(f"image {path} is a folder, not an image file")
            continue
        if not os.path.isfile(path):
            problems.append(f"image file not found: {path}")
            continue
        try:
            sizes.append(decoded_size(path))
        except Exception as e:  # noqa: BLE001 - any decoder failure is a data error
            problems.append(f"cannot decode image {path}: {e}")
    if video_urls:
        return problems
    try:
        video_plan = plan_videos(turns, videos, media, config.videos, config.seed, source, line)
        for video, info, taken in zip(videos, video_plan.infos, video_plan.indices):  # decoded once, here
            decode_frames(media.video(video.path), info, taken)
    except UserError as e:
        problems.append(str(e))
    if problems:
        return problems
    try:
        layout = layout_record(turns, [media.image_name(rel) for rel in images], sizes, video_plan, tokenizer, config)
    except RecordProblems as e:
        return e.problems
    return (list(layout.sizes), list(layout.items), list(layout.fields), layout.tokens, layout.kept, layout.real,
            layout.truncated, layout.without_loss)


def merge_shares(meta_path: str, sources: list[SourceSpec], shares: list[ScanShare], config: ReaderConfig) -> ScanResult:
    """The ScanResult of all ``shares`` together (records back in file order), or every problem found."""
    errors = sorted(e for share in shares for e in share.errors)
    skipped = tuple(e[-1] for e in errors) if config.skip_bad else ()
    # records back in file order (by source, then line), each with its images
    records = np.concatenate([share.records for share in shares])
    images = np.concatenate([share.images for share in shares])
    counts = np.concatenate([share.images_per_record for share in shares])
    first_image = np.cumsum(counts) - counts  # in ``images``: shares concatenated, records in share order
    by_line = np.lexsort((records[:, 2], records[:, 0]))
    records, counts, first_image = records[by_line], counts[by_line], first_image[by_line]
    img_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    images = images[np.repeat(first_image - img_ptr[:-1], counts) + np.arange(img_ptr[-1])]
    messages = [] if config.skip_bad else [e[-1] for e in errors]
    order_parts = []
    for s_idx, src in enumerate(sources):
        n_records = int((records[:, 0] == s_idx).sum())
        first_record = int((records[:, 0] < s_idx).sum())
        if not shares[0].nonblank_lines[s_idx]:
            messages.append(f"{src.annotation}: annotation file holds no records (entry {src.name!r} of {meta_path})")
        if src.length is not None and src.length != n_records and not any(e[0] <= s_idx for e in errors):
            messages.append(f"{meta_path}: entry {src.name!r} says length {src.length} but "
                            f"{src.annotation} has {n_records} records")
        rng = np.random.default_rng([config.seed, s_idx])
        order_parts.append(first_record + _repeat_indices(n_records, src.repeat_time, rng))
    if config.skip_bad and errors and not len(records):
        messages.append(f"{meta_path}: every record has a problem ({len(errors)} problem(s); first: {errors[0][-1]})")
    if messages:
        listed = "\n  ".join(messages[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(messages) - MAX_LISTED_ERRORS} more" if len(messages) > MAX_LISTED_ERRORS else ""
        raise DataValidationError(f"{len(messages)} problem(s) in the data of {meta_path}:\n  {listed}{more}")
    num_truncated = sum(share.num_truncated for share in shares)
    order = np.concatenate(order_parts) if order_parts else np.zeros(0, np.int64)
    rec = [np.ascontiguousarray(records[:, j]) for j in range(7)]
    img = [np.ascontiguousarray(images[:, j]) for j in range(6)]
    return ScanResult(sources, rec[0], rec[1], rec[2], img_ptr, img[0], img[1], img[2], img[3], img[4], img[5], rec[3],
                      rec[4], rec[5], rec[6], order.astype(np.int64), num_truncated,
                      sum(share.num_without_loss for share in shares), skipped)


class RecordDataset(torch.utils.data.Dataset):
    """Map-style dataset over a meta JSON (or one annotation JSONL); validated in full at construction.

    ``images``: the family's image rule (``DataSide.image_rule``), ``videos`` its video rule (``DataSide.video_rule``,
    None: video records refused); a video's blocks count as images below.
    ``__getitem__(i)`` -> ``{"input_ids": int64 [n],
    "labels": int64 [n], "pixel_values": float32 [k, ...], "image_flags": int64 [k], "image_sizes": int64
    [images, 2]}`` (a record with videos: also ``video_blocks`` and ``mm_token_type_ids``, ``video_fields``) with ``n == sample_lengths()[0][i]`` tokens, ``k == sample_lengths()[1][i]`` ViT items (the
    rule's ``pixels`` rows) and the (width, height) px of each kept image.  ``scan_group`` and ``cache_dir``: see
    ``scan_annotations``.
    """

    def __init__(self, meta_path: str, tokenizer, images: ImageRule, max_seq_length: int | None = None,
                 truncate: bool = False, *, system: str | None = None, add_bos: bool = True, seed: int = 0,
                 progress: bool = False, scan_group=None, cache_dir: str | None = None,
                 skip_bad: bool = False, videos: VideoRule | None = None) -> None:
        self.meta_path = meta_path
        self.tokenizer = tokenizer
        self.config = ReaderConfig(images=images, max_seq_length=max_seq_length, truncate=truncate, system=system,
                                   add_bos=add_bos, seed=seed, skip_bad=skip_bad, videos=videos)
        self.scan = scan_annotations(meta_path, tokenizer, self.config, progress=progress, group=scan_group,
                                     cache_dir=cache_dir)

    def __len__(self) -> int:
        return len(self.scan.order)

    def sample_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [N], ViT items int64 [N]) of every sample, dummy items counted; no pixel decode."""
        s = self.scan
        return s.rec_tokens[s.order].copy(), s.rec_items[s.order].copy()

    def sample_stats(self) -> SampleStats:
        """Every sample's stats (as ``omnibal isf stats --write`` writes them): ViT items, tokens, each kept
        image's width, height (px) and ViT items, and each kept video's (``scan_media``); no pixel decode."""
        images, videos = scan_media(self.scan)
        tokens, items = self.sample_lengths()
        return SampleStats(items, tokens, np.zeros(len(self), dtype=np.int32), [self.meta_path], images, videos)

    def image_grids(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, cols) int64 patch grid of each image of ``sample_stats().images`` (the image rule's), or None
        when the rule's items are not patch grids (tiles)."""
        im = self.sample_stats().images
        rule = self.config.images
        grids = [rule.grid(int(w), int(h)) for w, h in zip(im.width, im.height)]
        if any(g is None for g in grids):
            return None
        return (np.array([g[1] for g in grids], dtype=np.int64).reshape(-1),
                np.array([g[2] for g in grids], dtype=np.int64).reshape(-1))

    def sample_real_items(self) -> np.ndarray:
        """int64 [N]: ViT items of real images per sample (the sum of its ``image_flags``)."""
        return self.scan.rec_real_items[self.scan.order].copy()

    def where(self, index: int) -> str:
        """``annotation:line`` of sample ``index``."""
        return self.scan.where(int(self.scan.order[index]))

    def __getitem__(self, index: int) -> dict:
        return self.sample(index)

    def sample(self, index: int, decode_images: bool = True) -> dict:
        """Sample ``index``; ``decode_images=False`` opens no image file: ``pixel_values`` is left out and
        ``image_flags`` comes from the validation scan's item counts (the text's image tokens depend on the
        counts only, so tokens and labels are the same as with images)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        s, cfg = self.scan, self.config
        r = int(s.order[index])
        src = s.sources[s.rec_source[r]]
        with open(src.annotation, "rb") as f:
            f.seek(int(s.rec_offset[r]))
            record = json.loads(f.readline())
        turns, images, videos = record_turns(record)
        media = FileMedia(src.root)
        video_plan = plan_videos(turns, videos, media, cfg.videos, cfg.seed, int(s.rec_source[r]), int(s.rec_line[r]))
        layout = self.layout(r, video_plan)
        if sum(map(len, video_plan.blocks)) + len(images) != len(layout.items):
            raise DataValidationError(f"{s.where(r)}: its videos changed since validation")
        text = sample_text(layout, turns, videos, video_plan, cfg, self.tokenizer)
        if not decode_images:
            return {**text, "image_flags": image_flags(layout, cfg.images)}
        return {**text, **sample_pixels(layout, turns, images, videos, video_plan, media, cfg, s.where(r))}

    def layout(self, record: int, video_plan: VideoPlan) -> RecordLayout:
        """The ``RecordLayout`` of record ``record`` from the scan's counts (no image opened)."""
        s, rule = self.scan, self.config.images
        lo, hi = int(s.img_ptr[record]), int(s.img_ptr[record + 1])
        items = [int(n) for n in s.img_items[lo:hi]]
        sizes = tuple((int(w), int(h)) for w, h in zip(s.img_width[lo:hi], s.img_height[lo:hi]))
        fields = tuple((int(v), int(f), int(t)) for v, f, t in zip(s.img_video[lo:hi], s.img_frames[lo:hi],
                                                                     s.img_temporal[lo:hi]))
        plan = plan_conversation(list(video_plan.turns), self.tokenizer, [rule.image_tokens(n) for n in items], 1,
                                 self.config.system, self.config.add_bos)
        return RecordLayout(tuple(items), sizes, fields, plan, int(s.rec_tokens[record]),
                            int(s.rec_images_kept[record]), int(s.rec_real_items[record]))
