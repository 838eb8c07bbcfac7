"""Per-sample statistics in the OmniBal format: how many ViT tiles and LLM tokens each sample has.

A stats file is a JSON list with one object per sample::

    [{"vit_num": 5, "token_num": 1341, "image_flags": 5}, ...]

``vit_num`` is the number of image tiles the sample feeds the ViT (may be 0 for text-only samples,
or 1 for a dummy tile), ``token_num`` its full LLM sequence length in tokens (image tokens included).
At native resolution a record may also list its images::

    {"vit_num": 2, "token_num": 900, "images": [{"width": 640, "height": 480, "patches": 1564}, ...]}

``width``/``height`` the image's size in px, ``patches`` the 14 x 14 px patches smart_resize gives it
(``data/native.py``; ``tiles`` in its place for a tiled family's images, as ``omnibal isf stats --write`` writes
them: the ViT items either way); when one record has ``images`` every record must (``[]`` for none).
A record may also list its videos (``omnibal isf stats --write`` of video data)::

    {"vit_num": 120, "token_num": 400, "images": [],
     "videos": [{"frames": 16, "width": 320, "height": 240, "patches": 1920, "temporal": 8}]}

``frames`` the frames sampled (before temporal padding), ``width``/``height`` the source frame size in px,
``patches`` the ViT items of the whole video (patches at native resolution, tiles for frames as tiles) and
``temporal`` its attention segments in time (temporal patches of the Qwen ViTs, each attended as one image of
``patches / temporal`` patches; frames for frames as tiles).  A file without ``videos`` has none (old files load
unchanged); a video's items are in ``vit_num`` and not among the ``images``.
Other keys are ignored.  Several files concatenate in the order given; each sample keeps the index
of its file (``source``) for the multi-group mode.  A gzip-compressed file (such as the published
stats shipped in ``data/omnibal_stats/*.json.gz``) is read the same way, recognised by its content.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from ..errors import UserError

REQUIRED_KEYS = ("vit_num", "token_num")
IMAGE_KEYS = ("width", "height", "patches")
VIDEO_KEYS = ("frames", "width", "height", "patches", "temporal")


class StatsError(UserError):
    """A stats file or record that cannot be used; the message names the file and the record."""


def per_sample_sums(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sums of per-item ``values`` over each sample's items of CSR ``offsets``: (n,) (0 for a sample without)."""
    out = np.zeros(len(offsets) - 1, dtype=np.asarray(values).dtype)
    counts = np.diff(offsets)
    has = counts > 0
    if has.any():
        out[has] = np.add.reduceat(np.asarray(values), offsets[:-1][has])
    return out


class _PerItem:
    """Per-item sizes of the samples in CSR form: sample ``i`` has items ``offsets[i]:offsets[i+1]`` (int64 (n+1,)),
    and each field of ``FIELDS`` holds one positive int64 per item.  ``ImageStats`` and ``VideoStats`` are its
    two kinds."""

    FIELDS: tuple[str, ...] = ()
    WHAT = "item"

    def __post_init__(self) -> None:
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        for name in self.FIELDS:
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        k = len(self.patches)
        if (self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0 or self.offsets[-1] != k
                or np.any(np.diff(self.offsets) < 0) or any(getattr(self, n).shape != (k,) for n in self.FIELDS)):
            raise StatsError(f"{type(self).__name__}: offsets must rise from 0 to the {self.WHAT} count, "
                             f"{'/'.join(self.FIELDS)} one each")
        if k and min(getattr(self, n).min() for n in self.FIELDS) <= 0:
            raise StatsError(f"{type(self).__name__}: {self.WHAT} {', '.join(self.FIELDS)} must be positive")

    @classmethod
    def from_rows(cls, counts: Sequence[int], rows: Sequence[tuple[int, ...]]):
        """From each sample's item count and one row of ``FIELDS`` values per item, the samples' items in order."""
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(offsets, *np.asarray(rows, dtype=np.int64).reshape(-1, len(cls.FIELDS)).T)

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    def per_sample(self, values: np.ndarray) -> np.ndarray:
        """Sum of per-item ``values`` over each sample's items: (n,) (0 for a sample without any)."""
        return per_sample_sums(self.offsets, values)

    def subset(self, indices: np.ndarray):
        """The samples ``indices``, in that order, with their items."""
        indices = np.asarray(indices, dtype=np.int64)
        counts = np.diff(self.offsets)[indices]
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        take = np.repeat(self.offsets[:-1][indices] - offsets[:-1], counts) + np.arange(offsets[-1])
        return type(self)(offsets, *(getattr(self, n)[take] for n in self.FIELDS))

    @classmethod
    def concat(cls, parts: Sequence):
        """The samples of ``parts``, one after the other."""
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            offsets.append(p.offsets[1:] + base)
            base += int(p.offsets[-1])
        return cls(np.concatenate(offsets), *(np.concatenate([getattr(p, n) for p in parts] + [np.zeros(0, np.int64)])
                                              for n in cls.FIELDS))


@dataclass
class ImageStats(_PerItem):
    """Per-image sizes of the samples (``_PerItem``): width, height: int64 px of each image (before resizing);
    patches: its ViT items (14 x 14 px patches after smart_resize, or tiles)."""

    FIELDS: ClassVar[tuple[str, ...]] = ("width", "height", "patches")
    WHAT: ClassVar[str] = "image"

    offsets: np.ndarray
    width: np.ndarray
    height: np.ndarray
    patches: np.ndarray


@dataclass
class VideoStats(_PerItem):
    """Per-video sizes of the samples (``_PerItem``): frames: sampled frames of each video; width, height: its source
    frame size in px; patches: its ViT items (all temporal patches); temporal: its attention segments in time."""

    FIELDS: ClassVar[tuple[str, ...]] = VIDEO_KEYS
    WHAT: ClassVar[str] = "video"

    offsets: np.ndarray
    frames: np.ndarray
    width: np.ndarray
    height: np.ndarray
    patches: np.ndarray
    temporal: np.ndarray

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.patches) and np.any(self.patches % self.temporal):
            bad = int(np.flatnonzero(self.patches % self.temporal)[0])
            raise StatsError(f"VideoStats: video {bad}'s {self.patches[bad]} patches are not whole temporal patches "
                             f"({self.temporal[bad]})")

    @classmethod
    def none(cls, num_samples: int) -> "VideoStats":
        """No video in any of ``num_samples`` samples."""
        z = np.zeros(0, dtype=np.int64)
        return cls(np.zeros(num_samples + 1, dtype=np.int64), z, z, z, z, z)

    @property
    def patches_per_segment(self) -> np.ndarray:
        """ViT items of one temporal patch of each video (int64 (k,)): the size of each of its attention segments."""
        return self.patches // self.temporal


@dataclass
class SampleStats:
    """Statistics of ``n`` samples.

    vit: int64 (n,), ViT tiles per sample.
    tokens: int64 (n,), LLM tokens per sample.
    source: int32 (n,), index into ``files`` of the file each sample came from.
    files: the stats files (or dataset names), in load order.
    images: each sample's images (size and patches) when the stats hold them, else None.
    videos: each sample's videos (frames, size, patches, temporal patches) when the stats hold any, else None.
    """

    vit: np.ndarray
    tokens: np.ndarray
    source: np.ndarray
    files: list[str] = field(default_factory=list)
    images: ImageStats | None = None
    videos: VideoStats | None = None

    def __post_init__(self) -> None:
        self.vit = np.asarray(self.vit, dtype=np.int64)
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.source = np.asarray(self.source, dtype=np.int32)
        n = len(self.vit)
        if self.vit.ndim != 1 or self.tokens.shape != (n,) or self.source.shape != (n,):
            raise StatsError(
                f"SampleStats: vit, tokens and source must be 1-D of one length, got shapes "
                f"{self.vit.shape}, {self.tokens.shape}, {self.source.shape}"
            )
        if n and (self.vit.min() < 0 or self.tokens.min() < 0):
            bad = np.flatnonzero((self.vit < 0) | (self.tokens < 0))
            raise StatsError(f"SampleStats: negative vit/tokens at sample indices {bad[:10].tolist()}")
        if n and (self.source.min() < 0 or (self.files and self.source.max() >= len(self.files))):
            raise StatsError(f"SampleStats: source ids must index files (0..{len(self.files) - 1})")
        if self.images is not None and self.images.num_samples != n:
            raise StatsError(f"SampleStats: images describe {self.images.num_samples} samples, not {n}")
        if self.videos is not None and self.videos.num_samples != n:
            raise StatsError(f"SampleStats: videos describe {self.videos.num_samples} samples, not {n}")

    def __len__(self) -> int:
        return len(self.vit)

    def subset(self, indices: np.ndarray) -> "SampleStats":
        """The samples at ``indices`` (in that order)."""
        indices = np.asarray(indices, dtype=np.int64)
        images = None if self.images is None else self.images.subset(indices)
        videos = None if self.videos is None else self.videos.subset(indices)
        return SampleStats(self.vit[indices], self.tokens[indices], self.source[indices], list(self.files), images,
                           videos)

    @property
    def patches(self) -> np.ndarray:
        """Patches per sample (sum over its images and videos): int64 (n,); StatsError when the stats hold no
        images."""
        if self.images is None and self.videos is None:
            raise StatsError(f"{', '.join(self.files) or 'these stats'}: no per-image sizes (\"images\"), so no patch "
                             "counts; write them with a pre-training scan or derive them (omnibal_ext.data.native)")
        patches = (np.zeros(len(self), np.int64) if self.images is None
                   else self.images.per_sample(self.images.patches))
        return patches if self.videos is None else patches + self.videos.per_sample(self.videos.patches)

    def in_vision_items(self, item: str) -> "SampleStats":
        """These stats with ``vit`` holding the ViT's work in ``item`` (``vision_items``): what the planners
        count for a family (patches at native resolution)."""
        if item == "tile":
            return self
        return SampleStats(self.vision_items(item), self.tokens, self.source, list(self.files), self.images,
                           self.videos)

    def vision_items(self, item: str) -> np.ndarray:
        """The ViT's work per sample in a family's unit (``Family.vision_item``): "tile" -> ``vit``, "patch" ->
        ``patches``."""
        if item == "tile":
            return self.vit
        if item == "patch":
            return self.patches
        raise ValueError(f"vision_items: unknown item {item!r} (tile or patch)")

    def summary(self) -> dict:
        """Counts and means per file and overall (tiles and tokens per sample; with per-image sizes also
        images and patches per sample)."""
        patches = self.patches if self.images is not None else None
        images = np.diff(self.images.offsets) if self.images is not None else None
        videos = self.videos

        def describe(mask: np.ndarray) -> dict:
            v, t = self.vit[mask], self.tokens[mask]
            if len(v) == 0:
                return {"samples": 0}
            out = {
                "samples": int(len(v)),
                "tiles_mean": float(v.mean()), "tiles_max": int(v.max()),
                "tiles_zero": int((v == 0).sum()),
                "tokens_mean": float(t.mean()), "tokens_min": int(t.min()), "tokens_max": int(t.max()),
                "tokens_p99": float(np.percentile(t, 99)),
            }
            if patches is not None:
                out.update({"images_mean": float(images[mask].mean()), "patches_mean": float(patches[mask].mean()),
                            "patches_max": int(patches[mask].max())})
            if videos is not None:
                count = np.diff(videos.offsets)[mask]
                out.update({"videos_mean": float(count.mean()),
                            "video_frames_mean": float(videos.per_sample(videos.frames)[mask].sum()
                                                       / max(1, count.sum())),
                            "video_patches_mean": float(videos.per_sample(videos.patches)[mask].sum()
                                                        / max(1, count.sum())),
                            "samples_with_video": int((count > 0).sum())})
            return out

        out = {"all": describe(np.ones(len(self), dtype=bool)), "files": {}}
        for i, name in enumerate(self.files):
            out["files"][name] = describe(self.source == i)
        return out


def from_arrays(vit, tokens, source=None, files: Sequence[str] | None = None) -> SampleStats:
    """SampleStats from plain arrays (one source ``"arrays"`` unless given)."""
    vit = np.asarray(vit, dtype=np.int64)
    if source is None:
        source = np.zeros(len(vit), dtype=np.int32)
    if files is None:
        files = [f"source{i}" for i in range(int(np.max(source)) + 1)] if len(vit) else ["arrays"]
    return SampleStats(vit, np.asarray(tokens, dtype=np.int64), np.asarray(source), list(files))


def _is_count(x) -> bool:
    return type(x) is int and x >= 0  # bool is not int here (type() is exact)


def _record_error(path: str, records: list, key: str | None = None) -> StatsError:
    """Find the first bad record (slow path, only on failure) and describe it."""
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            return StatsError(f"{path}: record {i} is {type(rec).__name__}, expected an object with "
                              f"{' and '.join(REQUIRED_KEYS)}")
        for k in REQUIRED_KEYS:
            if k not in rec:
                return StatsError(f"{path}: record {i} has no {k!r} (keys: {sorted(rec)})")
            if not _is_count(rec[k]):
                return StatsError(f"{path}: record {i}: {k!r} must be a non-negative integer, got {rec[k]!r}")
    return StatsError(f"{path}: invalid records")


def parse_images(records: list, path: str) -> ImageStats | None:
    """The records' ``images`` lists as ImageStats, or None when no record has one; StatsError names ``path``
    and the record of a missing or malformed list."""
    first = next((i for i, r in enumerate(records) if "images" in r), None)
    if first is None:
        return None
    counts, values = [], []
    for i, rec in enumerate(records):
        images = rec.get("images")
        if not isinstance(images, list):
            raise StatsError(f"{path}: record {i} has no \"images\" list (record {first} has one; give every record "
                             "one, [] for no image)")
        for j, im in enumerate(images):
            keys = IMAGE_KEYS if not isinstance(im, dict) or "tiles" not in im else ("width", "height", "tiles")
            if not isinstance(im, dict) or not all(_is_count(im.get(k)) and im.get(k) > 0 for k in keys):
                raise StatsError(f"{path}: record {i}, image {j}: expected positive integer "
                                 f"{', '.join(IMAGE_KEYS)} (or tiles), got {im!r}")
            values.append(tuple(im[k] for k in keys))
        counts.append(len(images))
    return ImageStats.from_rows(counts, values)


def parse_videos(records: list, path: str) -> VideoStats | None:
    """The records' ``videos`` lists as VideoStats (a record without one has none), or None when no record has
    one; StatsError names ``path`` and the record of a malformed list."""
    if not any("videos" in r for r in records):
        return None
    counts, values = [], []
    for i, rec in enumerate(records):
        videos = rec.get("videos", [])
        if not isinstance(videos, list):
            raise StatsError(f"{path}: record {i}: \"videos\" must be a list, got {type(videos).__name__}")
        for j, v in enumerate(videos):
            if not isinstance(v, dict) or not all(_is_count(v.get(k)) and v.get(k) > 0 for k in VIDEO_KEYS):
                raise StatsError(f"{path}: record {i}, video {j}: expected positive integer "
                                 f"{', '.join(VIDEO_KEYS)}, got {v!r}")
            if v["patches"] % v["temporal"]:
                raise StatsError(f"{path}: record {i}, video {j}: {v['patches']} patches are not whole temporal "
                                 f"patches ({v['temporal']})")
            values.append(tuple(v[k] for k in VIDEO_KEYS))
        counts.append(len(videos))
    return VideoStats.from_rows(counts, values)


def parse_records(records, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(vit, tokens) int64 arrays from a decoded JSON list; StatsError names ``path`` and the record."""
    if not isinstance(records, list):
        raise StatsError(f"{path}: expected a JSON list of per-sample objects, got {type(records).__name__}")
    try:
        vit = [r["vit_num"] for r in records]
        tok = [r["token_num"] for r in records]
    except (KeyError, TypeError):
        raise _record_error(path, records) from None
    if not (all(map(_is_count, vit)) and all(map(_is_count, tok))):
        raise _record_error(path, records)
    return np.fromiter(vit, np.int64, len(vit)), np.fromiter(tok, np.int64, len(tok))


GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: str | Path):
    """``path`` opened for reading text; a gzip-compressed file (by its first bytes) is decompressed."""
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rt", encoding="utf-8") if magic == GZIP_MAGIC else open(path, encoding="utf-8")


def load_stats_file(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(vit, tokens) of one stats file (JSON, or gzip-compressed JSON)."""
    vit, tokens, _ = load_stats_file_images(path)
    return vit, tokens


def load_stats_file_images(path: str | Path) -> tuple[np.ndarray, np.ndarray, ImageStats | None]:
    """(vit, tokens, images or None) of one stats file (JSON, or gzip-compressed JSON)."""
    vit, tokens, images, _ = load_stats_file_media(path)
    return vit, tokens, images


def load_stats_file_media(path: str | Path) -> tuple[np.ndarray, np.ndarray, ImageStats | None, VideoStats | None]:
    """(vit, tokens, images or None, videos or None) of one stats file (JSON, or gzip-compressed JSON)."""
    return parse_media(read_records(path), str(path))


def read_records(path: str | Path) -> list:
    """The decoded JSON of one stats file (JSON, or gzip-compressed JSON); StatsError names ``path``."""
    path = str(path)
    try:
        with open_text(path) as f:
            return json.load(f)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off gzip stream an EOFError
        raise StatsError(f"{path}: cannot read stats file: {getattr(e, 'strerror', None) or e}") from e
    except json.JSONDecodeError as e:
        raise StatsError(f"{path}: not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise StatsError(f"{path}: not valid JSON (not UTF-8 text): {e}") from e


def parse_media(records, path: str) -> tuple[np.ndarray, np.ndarray, ImageStats | None, VideoStats | None]:
    """(vit, tokens, images or None, videos or None) of a decoded stats list; StatsError names ``path``."""
    vit, tokens = parse_records(records, path)
    return vit, tokens, parse_images(records, path), parse_videos(records, path)


def load_stats(paths: Sequence[str | Path]) -> SampleStats:
    """Load and concatenate stats files; ``source[i]`` is the index of the file sample ``i`` came from."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise StatsError("no stats files given")
    return stats_of_records([(str(p), read_records(p)) for p in paths])


def stats_of_records(parts: Sequence[tuple[str, list]]) -> SampleStats:
    """The SampleStats of stats records held in memory, ``(name, records)`` per source in order (what
    :func:`load_stats` makes of files; ``omnibal plan --data META.json`` of the records a scan gives):
    ``source[i]`` is the index of the part sample ``i`` came from."""
    vits, toks, srcs, images, videos = [], [], [], [], []
    for i, (name, records) in enumerate(parts):
        v, t, im, vid = parse_media(records, name)
        vits.append(v)
        toks.append(t)
        srcs.append(np.full(len(v), i, dtype=np.int32))
        images.append(im)
        videos.append(vid)
    names = [name for name, _ in parts]
    if any(im is not None for im in images) and not all(im is not None for im in images):
        some = names[[im is None for im in images].index(False)]
        none = names[[im is None for im in images].index(True)]
        raise StatsError(f"{none}: no per-image sizes (\"images\") but {some} has them; give them for every file")
    merged = ImageStats.concat(images) if images[0] is not None else None
    merged_videos = None
    if any(vid is not None for vid in videos):  # a file without videos has none
        merged_videos = VideoStats.concat([vid if vid is not None else VideoStats.none(len(v))
                                           for vid, v in zip(videos, vits)])
    return SampleStats(np.concatenate(vits), np.concatenate(toks), np.concatenate(srcs), names, merged, merged_videos)


def resample_indices(num_samples: int, m: int, seed: int) -> np.ndarray:
    """``m`` sample indices drawn from ``range(num_samples)``: a random permutation of whole copies
    of the set plus a draw without replacement for the rest, so every sample appears
    ``m // num_samples`` or one more times (no sample over-represented by chance)."""
    if num_samples <= 0:
        raise StatsError("cannot resample an empty stats set")
    if m <= 0:
        raise StatsError(f"resample size must be positive, got {m}")
    rng = np.random.default_rng(seed)
    copies, rest = divmod(m, num_samples)
    parts = [np.tile(np.arange(num_samples, dtype=np.int64), copies)]
    parts.append(rng.choice(num_samples, size=rest, replace=False).astype(np.int64))
    idx = np.concatenate(parts)
    rng.shuffle(idx)
    return idx


def resample(stats: SampleStats, m: int, seed: int = 0) -> SampleStats:
    """``stats`` resampled to ``m`` samples (e.g. the paper's 1.2M size); see ``resample_indices``."""
    return stats.subset(resample_indices(len(stats), m, seed))
