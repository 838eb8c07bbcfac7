"""Per-sample statistics in the OmniBal format: how many ViT tiles and LLM tokens each sample has.

A stats file is a JSON list with one object per sample::

    [{"vit_num": 5, "token_num": 1341, "image_flags": 5}, ...]

``vit_num`` is the number of image tiles the sample feeds the ViT (may be 0 for text-only samples,
or 1 for a dummy tile), ``token_num`` its full LLM sequence length in tokens (image tokens included).
Other keys are ignored.  Several files concatenate in the order given; each sample keeps the index
of its file (``source``) for the multi-group mode.  A gzip-compressed file (such as the published
stats shipped in ``data/omnibal_stats/*.json.gz``) is read the same way, recognised by its content.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import UserError

REQUIRED_KEYS = ("vit_num", "token_num")


class StatsError(UserError):
    """A stats file or record that cannot be used; the message names the file and the record."""


@dataclass
class SampleStats:
    """Statistics of ``n`` samples.

    vit: int64 (n,), ViT tiles per sample.
    tokens: int64 (n,), LLM tokens per sample.
    source: int32 (n,), index into ``files`` of the file each sample came from.
    files: the stats files (or dataset names), in load order.
    """

    vit: np.ndarray
    tokens: np.ndarray
    source: np.ndarray
    files: list[str] = field(default_factory=list)

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

    def __len__(self) -> int:
        return len(self.vit)

    def subset(self, indices: np.ndarray) -> "SampleStats":
        """The samples at ``indices`` (in that order)."""
        indices = np.asarray(indices, dtype=np.int64)
        return SampleStats(self.vit[indices], self.tokens[indices], self.source[indices], list(self.files))

    def summary(self) -> dict:
        """Counts and means per file and overall (tiles and tokens per sample)."""

        def describe(mask: np.ndarray) -> dict:
            v, t = self.vit[mask], self.tokens[mask]
            if len(v) == 0:
                return {"samples": 0}
            return {
                "samples": int(len(v)),
                "tiles_mean": float(v.mean()), "tiles_max": int(v.max()),
                "tiles_zero": int((v == 0).sum()),
                "tokens_mean": float(t.mean()), "tokens_min": int(t.min()), "tokens_max": int(t.max()),
                "tokens_p99": float(np.percentile(t, 99)),
            }

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
    path = str(path)
    try:
        with open_text(path) as f:
            records = json.load(f)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off gzip stream an EOFError
        raise StatsError(f"{path}: cannot read stats file: {getattr(e, 'strerror', None) or e}") from e
    except json.JSONDecodeError as e:
        raise StatsError(f"{path}: not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise StatsError(f"{path}: not valid JSON (not UTF-8 text): {e}") from e
    return parse_records(records, path)


def load_stats(paths: Sequence[str | Path]) -> SampleStats:
    """Load and concatenate stats files; ``source[i]`` is the index of the file sample ``i`` came from."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise StatsError("no stats files given")
    vits, toks, srcs = [], [], []
    for i, p in enumerate(paths):
        v, t = load_stats_file(p)
        vits.append(v)
        toks.append(t)
        srcs.append(np.full(len(v), i, dtype=np.int32))
    return SampleStats(np.concatenate(vits), np.concatenate(toks), np.concatenate(srcs), [str(p) for p in paths])


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
