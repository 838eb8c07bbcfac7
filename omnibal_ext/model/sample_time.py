"""Predicted training time of each sample, ViT side and LLM side apart: what ISF balances at native resolution.

The cost model's time of a micro-batch is linear in five sums over its samples (``MicroBatchShape``): ViT items,
the ViT's squared full-attention segment lengths (one segment per image), its squared window lengths, LLM tokens
and the LLM's squared sample lengths (packed attention stays within a sample). Each is a sum over samples, so a
micro-batch's predicted time is the sum of its samples' times: ``time_coefficients`` reads the five rates off the
cost model (forward plus backward of every unit, TP all-reduces included), and ``sample_times`` gives every
sample its ViT-side (embedding, ViT layers, projector) and LLM-side (embedding, layers, head) seconds.
``tests/test_isf_native.py`` checks the sum of a group's sample times against the cost model of the group.

Videos (``SampleStats.videos``) count as the models attend them: a native-resolution ViT attends each temporal
patch of a video as one image (its ``cu_seqlens`` repeat ``h x w`` patches ``t`` times: full attention quadratic per
temporal patch, not per video; windowed layers tile each temporal slice), so a video of ``t`` temporal patches of
``rows x cols`` patches adds ``t`` times an image's segment sums of that grid (``video_segments_sq``).  Frames as
tiles are tiles: a family of fixed-size items (``Family.native_resolution`` False) counts them as it counts image
tiles.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ..data.native import patch_grid
from ..data.stats import SampleStats
from .cost_model import DeviceSpec, analytic_costs, get_device
from .shape import MicroBatchShape
from .spec import PROJECTOR, VISION_EMBED, VISION_LAYER, ModelSpec
from .units import family_of

VISION_CODES = (VISION_EMBED, VISION_LAYER, PROJECTOR)
BASIS = 1 << 20  # the size of the unit shapes the rates are read at (large: the float rounding stays tiny)


@dataclass(frozen=True)
class TimeCoefficients:
    """Seconds (forward + backward, one TP rank) per unit of each sum.

    vit_item: per ViT item (tile or patch); vit_full_sq / vit_window_sq: per squared patch of the
    full-attention / window segments; llm_token: per LLM token; llm_token_sq: per squared sample length.
    ViT-side units: embedding, ViT layers, projector; LLM side: the rest.
    """

    vit_item: float
    vit_full_sq: float
    vit_window_sq: float
    llm_token: float
    llm_token_sq: float


def _split_seconds(spec, shape, tp, device, attention) -> tuple[float, float]:
    costs = analytic_costs(spec, shape, tp, device, attention=attention)
    vit = sum(u.fwd_s + u.bwd_s for u in costs.units if u.code in VISION_CODES)
    llm = sum(u.fwd_s + u.bwd_s for u in costs.units if u.code not in VISION_CODES)
    return vit, llm


def time_coefficients(spec: ModelSpec, device: DeviceSpec, tp: int = 1, attention: str = "flash") -> TimeCoefficients:
    """The cost model's per-unit rates of ``spec`` on ``device`` at TP ``tp`` (see the module docstring)."""
    b = float(BASIS)

    def seconds(items=0, tokens=0, full=0.0, window=0.0, tokens_sq=0.0):
        shape = MicroBatchShape(items, tokens, llm_attn_tokens_sq=tokens_sq, vision_attn_tokens_sq=full,
                                vision_window_tokens_sq=window)
        return _split_seconds(spec, shape, tp, device, attention)

    item, _ = seconds(items=BASIS)
    full, _ = seconds(full=b * b)
    window, _ = seconds(window=b * b)
    _, token = seconds(tokens=BASIS)
    _, token_sq = seconds(tokens=BASIS, tokens_sq=b * b)
    return TimeCoefficients(item / b, full / b**2, window / b**2, token / b, (token_sq - token) / b**2)


@dataclass(frozen=True)
class SampleWork:
    """The five sums of each sample (float64 (n,)): ViT items, full-attention and window squared segment
    lengths (patches^2), LLM tokens, squared sample length (tokens^2)."""

    vit_items: np.ndarray
    vit_full_sq: np.ndarray
    vit_window_sq: np.ndarray
    llm_tokens: np.ndarray
    llm_tokens_sq: np.ndarray


def sample_work(stats: SampleStats, spec: ModelSpec, grids=None) -> SampleWork:
    """Each sample's work for ``spec``'s family: ViT items in its unit (``Family.vision_item``), the squared
    segment sums of its images (``spec.vision.segments_sq`` of each image's patch grid, ``PatchVision``; zero for
    families whose items are fixed-size) and its tokens.  grids: (rows, cols) int arrays, the patch grid of each
    image of ``stats.images`` when the data side knows it (the trainer's scan), else recovered by ``patch_grid``."""
    family = family_of(spec)
    items = stats.vision_items(family.vision_item).astype(np.float64)
    full = window = np.zeros(len(stats))
    if family.native_resolution and stats.images is not None and len(stats.images.patches):
        im = stats.images
        rows, cols = grids if grids is not None else patch_grid(im.height, im.width, im.patches)
        f, w = spec.vision.segments_sq(rows, cols)
        full, window = im.per_sample(f), im.per_sample(w)
    if family.native_resolution and stats.videos is not None and len(stats.videos.patches):
        f, w = video_segments_sq(stats, spec)
        full, window = full + stats.videos.per_sample(f), window + stats.videos.per_sample(w)
    tokens = stats.tokens.astype(np.float64)
    return SampleWork(items, full, window, tokens, tokens**2)


def video_segments_sq(stats: SampleStats, spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """(full-attention, window) sums of squared segment lengths (patches^2) of each video of ``stats.videos``:
    ``temporal`` segments of one temporal patch each (module docstring), each the ViT's ``segments_sq`` of the
    ``rows x cols`` grid ``patch_grid`` recovers from the frame size and the patches per temporal patch."""
    v = stats.videos
    rows, cols = patch_grid(v.height, v.width, v.patches_per_segment)
    f, w = spec.vision.segments_sq(rows, cols)
    return v.temporal * f, v.temporal * w


def sample_times(work: SampleWork, coeffs: TimeCoefficients) -> tuple[np.ndarray, np.ndarray]:
    """(ViT-side seconds, LLM-side seconds) of each sample: float64 (n,)."""
    c = coeffs
    vit = c.vit_item * work.vit_items + c.vit_full_sq * work.vit_full_sq + c.vit_window_sq * work.vit_window_sq
    llm = c.llm_token * work.llm_tokens + c.llm_token_sq * work.llm_tokens_sq
    return vit, llm


TIME_UNIT_S = 1e-9  # ISF's integer time unit (nanoseconds)


def time_units(work: SampleWork, coeffs: TimeCoefficients) -> tuple[np.ndarray, np.ndarray]:
    """``sample_times`` in ISF's integer units (``TIME_UNIT_S``): int64 (n,) each."""
    vit, llm = sample_times(work, coeffs)
    return (np.round(vit / TIME_UNIT_S).astype(np.int64), np.round(llm / TIME_UNIT_S).astype(np.int64))


def sample_time_units(stats: SampleStats, spec: ModelSpec, device: DeviceSpec, tp: int = 1,
                      attention: str = "flash", grids=None) -> tuple[np.ndarray, np.ndarray]:
    """(ViT, LLM) predicted time of each sample in ISF's integer units (``TIME_UNIT_S``), int64 (n,); ``grids``:
    see ``sample_work``."""
    return time_units(sample_work(stats, spec, grids), time_coefficients(spec, device, tp, attention))


def with_tokens(work: SampleWork, tokens: np.ndarray) -> SampleWork:
    """``work`` with other LLM tokens per sample (e.g. padded under CP): its ViT sums kept."""
    t = np.asarray(tokens).astype(np.float64)
    return dataclasses.replace(work, llm_tokens=t, llm_tokens_sq=t**2)


ISF_TIME_DEVICE = "h200-141g"  # the cost model's device of ISF in time when none is named (the trainer without a plan)


def isf_sample_times(stats: SampleStats, spec: ModelSpec, device: DeviceSpec, tp: int = 1, grids=None,
                     work: SampleWork | None = None) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]] | None:
    """What ISF in time groups ``stats`` by: (ViT items int64 (n,) in the family's unit, (ViT, LLM) predicted time
    int64 (n,) each in ``TIME_UNIT_S``, ``sample_time_units`` of ``spec`` on ``device`` at TP ``tp``), or None for a
    family whose ViT items cost alike (``Family.native_resolution`` False: grouped by counts).  The stats' tokens are
    what ISF counts (padded under CP).  The one per-sample time model of the trainer and of ``omnibal plan``.
    work: the stats' ``sample_work`` when the caller holds it (it does not depend on TP; a planner trying several TPs
    computes it once), else computed from the stats and ``grids``."""
    family = family_of(spec)
    if not family.native_resolution:
        return None
    if work is None:
        work = sample_work(stats, spec, grids)
    return stats.vision_items(family.vision_item), time_units(work, time_coefficients(spec, device, tp))


@dataclass(frozen=True)
class VisionSegments:
    """The ViT attention segments of a dataset per ViT item, for shapes built from item counts alone (the planner's
    micro-batches): full-attention and window squared lengths per item on average over the data (``mean_*``: a
    micro-batch of the data's images) and at most (``max_*``: the largest image's, an upper bound of any
    micro-batch's, since ``sum P_i^2 <= max P * sum P``)."""

    mean_full: float
    mean_window: float
    max_full: float
    max_window: float

    def shape_sq(self, items: float, mean: bool) -> dict:
        """``MicroBatchShape`` keywords of the ViT segments of ``items`` ViT items."""
        full, window = (self.mean_full, self.mean_window) if mean else (self.max_full, self.max_window)
        return {"vision_attn_tokens_sq": float(items) * full, "vision_window_tokens_sq": float(items) * window}


def vision_segments(stats: SampleStats, spec: ModelSpec) -> VisionSegments | None:
    """The data's ViT segments per item (``VisionSegments``), or None for a family with fixed-size items."""
    has_images = stats.images is not None and len(stats.images.patches)
    has_videos = stats.videos is not None and len(stats.videos.patches)
    if not family_of(spec).native_resolution or not (has_images or has_videos):
        return None
    work = sample_work(stats, spec)
    ratios_full, ratios_window = [np.zeros(0)], [np.zeros(0)]  # per image or video: squared sums per ViT item
    if has_images:
        im = stats.images
        rows, cols = patch_grid(im.height, im.width, im.patches)
        full, window = spec.vision.segments_sq(rows, cols)
        ratios_full.append(full / im.patches)
        ratios_window.append(window / im.patches)
    if has_videos:
        full, window = video_segments_sq(stats, spec)
        ratios_full.append(full / stats.videos.patches)
        ratios_window.append(window / stats.videos.patches)
    total = max(float(work.vit_items.sum()), 1.0)
    return VisionSegments(float(work.vit_full_sq.sum()) / total, float(work.vit_window_sq.sum()) / total,
                          float(np.concatenate(ratios_full).max()), float(np.concatenate(ratios_window).max()))


@functools.lru_cache(maxsize=16)
def _cached_coefficients(spec: ModelSpec, device: DeviceSpec, tp: int) -> TimeCoefficients:
    return time_coefficients(spec, device, tp)


def grid_vit_time_units(spec: ModelSpec, grids, device: DeviceSpec | None = None, tp: int = 1) -> np.ndarray:
    """Predicted ViT-side time (``TIME_UNIT_S`` units, int64 (k,)) of each image or video of ``grids`` (``grid_thw``
    rows ``(t, rows, cols)`` in patches) for a family of native resolution (``spec.vision.segments_sq``): ``t``
    segments of ``rows x cols`` patches (one per temporal patch, module docstring); what CP balances whole images and
    videos by.  device: the cost model's (default ``ISF_TIME_DEVICE``)."""
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if not len(g):
        return np.zeros(0, dtype=np.int64)
    c = _cached_coefficients(spec, device or get_device(ISF_TIME_DEVICE), tp)
    t, rows, cols = (g[:, j].astype(np.float64) for j in range(3))
    full, window = spec.vision.segments_sq(rows, cols)
    seconds = c.vit_item * t * rows * cols + c.vit_full_sq * t * full + c.vit_window_sq * t * window
    return np.round(seconds / TIME_UNIT_S).astype(np.int64)
